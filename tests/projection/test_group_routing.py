"""Group-limited routing (megatron-core's ``group_limited_topk``, DeepSeek-V3's 4 of 8 groups) in the flex
dispatcher's destination count: against every route of small routers enumerated by hand, against
megatron-core's own router on random logits (forced balance), and where the count enters the layer's
all-to-all, inside a node and across nodes."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest

from primuspipe.projection.comm import destination_ranks, destinations, layer_comm
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.megatron_args import read_arguments
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
HW = HardwareSpec(name="t", peak_bf16_tflops=100.0, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=1e12,
                  memory_bandwidth_fraction=1.0, intra_node_bandwidth_bytes_per_s=100e9,
                  inter_node_bandwidth_bytes_per_s=10e9, network_efficiency=1.0, gpus_per_node=8)
MC_TOLERANCE = 0.04
"""The drawn count's standard error is under 0.01 destinations on these shapes; 4 of them."""


def router(experts: int, k: int, groups: int | None = None, picked: int | None = None, **fields) -> ModelSpec:
    return ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                     num_experts=experts, moe_router_topk=k, moe_router_num_groups=groups,
                     moe_router_group_topk=picked, **fields)


def enumerated(experts: int, k: int, groups: int, experts_each: int) -> float:
    """Mean destinations over every order of ``experts`` independent logits, routed as ``group_limited_topk``
    routes them when each group is ranked by its best score (``k // group_topk`` = 1: only the order counts)."""
    size, total, orders = experts // groups, 0, 0
    for order in itertools.permutations(range(experts)):  # order[e]: expert e's rank among the logits
        best = sorted(range(groups), key=lambda g: max(order[g * size:(g + 1) * size]), reverse=True)[:k]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=order.__getitem__, reverse=True)[:k]
        total += len({e // experts_each for e in chosen})
        orders += 1
    return total / orders


@pytest.mark.parametrize("experts_each", [1, 2, 4])
def test_the_count_equals_every_enumerated_route_of_a_small_router(experts_each):
    """8 experts in 4 groups of 2, 2 groups picked, top-2: groups the size of a rank (2), smaller (1 expert a
    destination: groups span destinations) and larger (a destination holds 2 groups)."""
    model = router(8, 2, 4, 2)
    assert destinations(model, experts_each) == pytest.approx(enumerated(8, 2, 4, experts_each), abs=MC_TOLERANCE)


def test_picking_every_group_is_routing_without_groups():
    for experts, k, groups, each in ((64, 8, 8, 8), (32, 4, 4, 4), (48, 6, 6, 16), (64, 8, 4, 2)):
        free = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                         num_experts=experts, moe_router_topk=k)
        exact = experts / each * (1 - math.comb(experts - each, k) / math.comb(experts, k))
        assert destinations(free, each) == pytest.approx(exact)
        assert destinations(router(experts, k, groups, groups), each) == pytest.approx(exact, abs=MC_TOLERANCE)


def _megatron_destinations(model: ModelSpec, experts_each: int, tokens: int = 8192) -> float:
    import torch

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(tokens, model.num_experts, generator=generator)  # forced balance: RandomSTE's normal_()
    bias = torch.zeros(model.num_experts) if model.moe_router_score_function == "sigmoid" else None
    _, routing_map = topk_routing_with_score_function(
        logits, model.moe_router_topk, use_pre_softmax=model.moe_router_pre_softmax,
        num_groups=model.moe_router_num_groups, group_topk=model.moe_router_group_topk,
        score_function=model.moe_router_score_function, expert_bias=bias)
    per = routing_map.view(tokens, model.num_experts // experts_each, experts_each).any(-1)
    return per.sum(-1).double().mean().item()


@pytest.mark.parametrize("experts_each", [32, 64, 16, 4])
def test_deepseek_v3_routes_as_megatron_cores_router_does(experts_each):
    """DeepSeek-V3's router (256 experts, 8 groups, 4 picked, top-8, sigmoid) on random logits: groups aligned to
    EP 8's ranks (32 experts) and to EP 64's nodes (32), a rank holding two groups (EP 4: 64), groups spanning 2
    or 8 ranks (EP 16, EP 64)."""
    model = load_model(EXAMPLES / "models" / "deepseek-v3.yaml")
    assert (model.moe_router_num_groups, model.moe_router_group_topk, model.moe_router_score_function) == (
        8, 4, "sigmoid")
    ours = destinations(model, experts_each)
    assert ours == pytest.approx(_megatron_destinations(model, experts_each), abs=MC_TOLERANCE)
    if experts_each >= 32:
        assert ours <= 4  # at most the 4 picked groups


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_softmax_routers_rank_groups_by_logits_or_probabilities(pre_softmax):
    """DeepSeek-V2's shape of router (softmax, 8 groups, 3 picked, top-6) scaled down: 64 experts; the groups
    are ranked by summed logits, or summed probabilities with moe_router_pre_softmax."""
    model = router(64, 6, 8, 3, moe_router_pre_softmax=pre_softmax)
    for each in (8, 16, 4):
        assert destinations(model, each) == pytest.approx(_megatron_destinations(model, each), abs=MC_TOLERANCE)


def test_the_flex_all_to_all_carries_one_row_per_picked_destination():
    model = load_model(EXAMPLES / "models" / "deepseek-v3.yaml")
    free = dataclasses.replace(model, moe_router_num_groups=None, moe_router_group_topk=None)
    inside = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=8, data_parallel_size=8,
                          global_batch_size=8, moe_token_dispatcher_type="flex")
    across = dataclasses.replace(inside, expert_model_parallel_size=64, data_parallel_size=64, global_batch_size=64)
    for training, ranks in ((inside, 8), (across, 64)):
        plain = dataclasses.replace(training, moe_token_dispatcher_type="alltoall")
        a2a = layer_comm(model, plain, HW, "moe").ep[0]
        latency = 2 * (ranks - 1) * (HW.intra_node_latency_s if ranks <= 8 else HW.inter_node_latency_s)
        grouped, ungrouped = layer_comm(model, training, HW, "moe").ep[0], layer_comm(free, training, HW, "moe").ep[0]
        # one row per rank inside the node, per node across nodes; with groups both are the picked groups' 32 experts
        assert grouped - latency == pytest.approx((a2a - latency) * destinations(model, 32) / 8)
        assert ungrouped - latency == pytest.approx((a2a - latency) * destinations(free, 32) / 8)
        assert grouped < ungrouped
    assert destination_ranks(model, inside) == destinations(model, 32)


def test_group_settings_are_read_from_megatron_arguments_and_checked():
    args = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1000 --num-experts 16 --moe-router-topk 4 --moe-router-num-groups 4 "
            "--moe-router-group-topk 2 --moe-router-score-function sigmoid --moe-router-pre-softmax "
            "--micro-batch-size 1 --global-batch-size 8 --bf16 ")
    config = read_arguments(args, "run")
    m = config.model
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_score_function, m.moe_router_pre_softmax) \
        == (4, 2, "sigmoid", True)
    assert not {"moe_router_num_groups", "moe_router_group_topk", "moe_router_score_function"} & set(config.no_effect)
    for bad, match in (({"moe_router_num_groups": 4}, "needs both"),
                       ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "equal groups"),
                       ({"moe_router_num_groups": 4, "moe_router_group_topk": 5}, "more groups"),
                       ({"moe_router_num_groups": 16, "moe_router_group_topk": 2}, "fewer experts")):
        with pytest.raises(InputError, match=match):
            ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=100,
                      num_experts=16, moe_router_topk=4, **bad)
