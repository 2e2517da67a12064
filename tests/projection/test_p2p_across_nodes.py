"""A context-parallel ring's hop to another node runs on one network card (issue 26, seventeenth session).

A ring collective spreads a node's share of its traffic over the cards of the group's members on that node; a ring
*shift* -- each rank sending its block to the next, as Transformer Engine's CP ring and PyTorch's ``permute_tensor``
do -- is one NCCL point-to-point connection per hop, which NCCL sends through one card (``ncclTopoGetNetDev``).
TP 4 x CP 4 on 8-GPU nodes puts two members of each CP ring on a node: the hop still has one card."""

from pathlib import Path

import pytest

from primuspipe.projection.comm import Collectives, layer_comm
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.training_spec import RankShape, TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
H100 = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
CARD = H100.inter_node_bandwidth_bytes_per_s * H100.network_efficiency
BYTES = 1e9


@pytest.mark.parametrize("ranks, span", [(4, 16), (8, 32), (2, 16), (8, 64)])
def test_a_ring_shift_across_nodes_moves_at_one_cards_rate(ranks, span):
    assert Collectives(H100).shift(BYTES, ranks, span) == pytest.approx(BYTES / CARD + H100.inter_node_latency_s)


def test_a_ring_collective_with_two_members_a_node_still_uses_both_cards():
    """The contrast the shift rule draws: an all-gather over the same group spreads over the members' two cards."""
    assert Collectives(H100).gather(BYTES, 4, 16) == pytest.approx(3 / 4 * BYTES / (2 * CARD)
                                                                   + 3 * H100.inter_node_latency_s)


def test_transformer_engines_ring_at_tp4_cp4_passes_each_block_at_one_cards_rate():
    """NeMo 24.03's long-sequence layout at 128K: TP 4, CP 4 on 16 GPUs (each CP ring on two nodes, two members on
    each): three passes of a quarter of the K and V, each at one card's rate."""
    model = load_model(EXAMPLES / "models" / "llama2-7b.yaml")
    training = TrainingSpec(tensor_model_parallel_size=4, context_parallel_size=4, pipeline_model_parallel_size=1,
                            data_parallel_size=1, global_batch_size=1, sequence_parallel=True)
    shape = RankShape(model, training)
    kv = shape.tokens * 4 * 2 * model.query_groups / 4 * model.head_dim * shape.e
    assert layer_comm(model, training, H100, "dense").cp[0] == pytest.approx(
        3 * (kv / 4 / CARD + H100.inter_node_latency_s))
