"""A fully connected mesh inside a node (issue 26): AMD's MI300X / MI325X / MI355X platforms join each GPU to each of
the other seven by its own xGMI link, with no switch, so a collective among ``k`` GPUs of a node has only the
``k - 1`` links among them -- where NVSwitch gives any group the whole fabric."""

import dataclasses
from pathlib import Path

import pytest

from primuspipe.projection.comm import Collectives, layer_comm
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import RankShape, TrainingSpec

HARDWARE = Path(__file__).resolve().parents[2] / "examples" / "projection" / "hardware"
MI355X = dataclasses.replace(load_hardware(HARDWARE / "mi355x.yaml"), intra_node_latency_s=1e-9,
                             inter_node_latency_s=1e-9)  # bandwidth alone
SWITCHED = dataclasses.replace(MI355X, intra_node_topology="switch")
LINK = 76.8e9 * MI355X.network_efficiency
BYTES = 1e9


def test_amd_files_are_meshes_and_nvidia_files_switches():
    for name in ("mi300x", "mi325x", "mi355x"):
        h = load_hardware(HARDWARE / f"{name}.yaml")
        assert h.intra_node_topology == "full-mesh"
        assert h.intra_node_bandwidth_bytes_per_s == pytest.approx(7 * h.intra_node_peer_bandwidth_bytes_per_s)
    for name in ("h100", "h100-hbm2e", "h200", "b200", "gb200"):
        assert load_hardware(HARDWARE / f"{name}.yaml").intra_node_topology == "switch"


def test_the_gb200_node_is_its_72_gpu_nvlink_domain():
    """gb200.yaml's gpus_per_node is the NVL72's NVLink domain, not its 4-GPU tray: a 64-way group (an EP 64 all-to-all,
    a data-parallel ring) runs on NVLink at 900 GB/s a direction; a group beyond 72 ranks crosses racks on the
    400 Gb/s cards, one a GPU."""
    gb200 = load_hardware(HARDWARE / "gb200.yaml")
    net = Collectives(gb200)
    inside = 63 / 64 * BYTES / (900e9 * gb200.network_efficiency) + 63 * gb200.intra_node_latency_s
    assert net.gather(BYTES, 64, 64) == pytest.approx(inside)
    assert net.gather(BYTES, 4, 144) == pytest.approx(3 / 4 * BYTES / (2 * 50e9 * gb200.network_efficiency)
                                                      + 3 * gb200.inter_node_latency_s)


@pytest.mark.parametrize("ranks, span", [(4, 4), (2, 8), (2, 2), (4, 8)])
def test_a_group_smaller_than_the_node_runs_on_the_links_among_its_members(ranks, span):
    """TP 4 (ranks 0-3), the FSDP pairs strided across it (ranks 0 and 4): every pair of a mesh is linked directly."""
    net = Collectives(MI355X)
    expected = (ranks - 1) / ranks * BYTES / ((ranks - 1) * LINK) + (ranks - 1) * 1e-9
    assert net.gather(BYTES, ranks, span) == pytest.approx(expected)
    assert net.all_reduce(BYTES, ranks, span) == pytest.approx(2 * expected)
    assert net.all_to_all(BYTES, ranks, span) == pytest.approx(expected)
    assert net.gather(BYTES, ranks, span) == pytest.approx(
        7 / (ranks - 1) * Collectives(SWITCHED).gather(BYTES, ranks, span), rel=1e-5)


def test_the_whole_node_has_every_link_either_way():
    assert Collectives(MI355X).gather(BYTES, 8, 8) == pytest.approx(Collectives(SWITCHED).gather(BYTES, 8, 8))


def test_a_ring_shift_inside_a_node_crosses_one_link():
    """PyTorch's context-parallel rotation sends each rank's block to the next rank only."""
    assert Collectives(MI355X).shift(BYTES, 4, 4) == pytest.approx(BYTES / LINK + 1e-9)
    assert Collectives(SWITCHED).shift(BYTES, 4, 4) == pytest.approx(BYTES / (7 * LINK) + 1e-9)


def test_an_all_to_all_across_nodes_sends_its_node_share_over_the_members_links():
    """EP 16 over two nodes with 4 members a node (span 32): the 3 local peers' shares go over 3 links, each its own."""
    mesh = dataclasses.replace(MI355X, inter_node_bandwidth_bytes_per_s=1e15)  # the fabric binds
    assert Collectives(mesh).all_to_all(BYTES, 16, 32) == pytest.approx(BYTES / 16 / LINK + 15e-9)


def test_a_mesh_without_its_link_bandwidth_is_refused():
    with pytest.raises(InputError, match="one of its links"):
        dataclasses.replace(MI355X, intra_node_peer_bandwidth_bytes_per_s=None)


def test_transformer_engines_cp_ring_passes_each_block_over_one_link():
    """CP 4 inside a node (te-p2p): three passes of a quarter of the K and V to the next rank, each on one link on the
    mesh; on a switch the three take what an all-gather of the whole takes."""
    model = load_model(HARDWARE.parent / "models" / "llama3-8b.yaml")
    training = TrainingSpec(tensor_model_parallel_size=1, context_parallel_size=4, pipeline_model_parallel_size=1,
                            data_parallel_size=1, global_batch_size=1)
    shape = RankShape(model, training)
    kv = shape.tokens * 4 * 2 * model.query_groups * model.head_dim * shape.e
    mesh, switched = (layer_comm(model, training, h, "dense").cp[0] for h in (MI355X, SWITCHED))
    assert mesh == pytest.approx(3 * (kv / 4 / LINK + 1e-9))
    assert switched == pytest.approx(Collectives(SWITCHED).gather(kv, 4, 4))
