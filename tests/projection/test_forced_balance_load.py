"""Forced balance is balanced on average only: megatron-core's random router logits give every EP rank a random
load, and each MoE layer waits for the busiest rank. The expected busiest load against megatron-core's own router
on random logits (plain and group-limited top-k), and where it enters the layer: the all-to-all and the expert
GEMMs of the busiest rank, smoothly (no tile count tipped), not under padding to capacity or AutoModel's fake gate."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from primuspipe.projection.comm import layer_comm
from primuspipe.projection.compute import WorkModel
from primuspipe.projection.gemm import Gemm, gemm_seconds
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.routing import busiest_rank_load, expected_normal_maximum
from primuspipe.projection.training_spec import RankShape, TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
H100 = load_hardware(EXAMPLES / "hardware" / "h100.yaml")


def router(experts: int, k: int, groups: int | None = None, picked: int | None = None, **fields) -> ModelSpec:
    return ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=1000,
                     num_experts=experts, moe_router_topk=k, moe_router_num_groups=groups,
                     moe_router_group_topk=picked, **fields)


def _megatron_busiest(model: ModelSpec, ep: int, tokens: int, trials: int = 150) -> float:
    """The busiest of ``ep`` ranks' copies over the mean, averaged over ``trials`` microbatches routed by
    megatron-core's ``topk_routing_with_score_function`` on standard normal logits (forced balance's ``RandomSTE``)."""
    import torch

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    generator = torch.Generator().manual_seed(2)
    bias = torch.zeros(model.num_experts) if model.moe_router_score_function == "sigmoid" else None
    mean = tokens * model.moe_router_topk / ep
    total = 0.0
    for _ in range(trials):
        logits = torch.randn(tokens, model.num_experts, generator=generator)
        _, routing_map = topk_routing_with_score_function(
            logits, model.moe_router_topk, use_pre_softmax=model.moe_router_pre_softmax,
            num_groups=model.moe_router_num_groups, group_topk=model.moe_router_group_topk,
            score_function=model.moe_router_score_function, expert_bias=bias)
        total += routing_map.view(tokens, ep, -1).sum((0, 2)).max().item() / mean
    return total / trials


def test_the_expected_maximum_of_normal_draws():
    assert expected_normal_maximum(1) == pytest.approx(0.0, abs=1e-9)
    assert expected_normal_maximum(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)  # E max of two: 1/sqrt(pi)
    assert expected_normal_maximum(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    assert expected_normal_maximum(8) == pytest.approx(1.4236, abs=1e-4)  # the tabled value


@pytest.mark.parametrize(("model", "ep", "tokens"), [
    (router(64, 4), 8, 1024),                       # plain top-k, 8 experts a rank
    (router(128, 8), 8, 2048),                      # Qwen3-30B-A3B's router at EP 8, a shorter microbatch
    (router(32, 2), 4, 512),                        # few experts, top-2
    (router(64, 8, 8, 4, moe_router_score_function="sigmoid"), 16, 1024),  # DeepSeek-V3's groups, scaled down
])
def test_the_busiest_rank_is_megatron_cores_router_on_random_logits(model, ep, tokens):
    ours = busiest_rank_load(model, ep, tokens)
    real = _megatron_busiest(model, ep, tokens)
    assert ours > 1.02
    assert ours - 1 == pytest.approx(real - 1, rel=0.1)


def test_more_tokens_spread_less_and_one_rank_waits_for_nobody():
    model = router(128, 8)
    loads = [busiest_rank_load(model, 8, tokens) for tokens in (1024, 4096, 16384)]
    assert loads[0] > loads[1] > loads[2] > 1
    assert (loads[0] - 1) / (loads[1] - 1) == pytest.approx(2.0)  # the spread falls as 1 / sqrt(tokens)
    assert busiest_rank_load(model, 1, 4096) == 1.0


def _moe_training(**fields) -> TrainingSpec:
    return TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=8, data_parallel_size=8,
                        global_batch_size=8, **fields)


def test_forced_balance_slows_the_busiest_ranks_experts_and_all_to_all_only():
    model = router(64, 4)
    forced = _moe_training(moe_router_force_load_balancing=True)
    shape = RankShape(model, forced)
    load = busiest_rank_load(model, 8, shape.residual_tokens * 8)
    assert shape.load_imbalance == pytest.approx(load) and load > 1
    even = dataclasses.replace(forced, moe_router_force_load_balancing=False)  # uniform routing, set figure 1
    assert RankShape(model, even).load_imbalance == 1.0
    assert RankShape(model, dataclasses.replace(forced, fake_balanced_gate=True)).load_imbalance == 1.0
    padded = dataclasses.replace(forced, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert RankShape(model, padded).load_imbalance == 1.0  # every expert computes its capacity, no more
    dropped = dataclasses.replace(padded, moe_pad_expert_input_to_capacity=False)
    assert RankShape(model, dropped).load_imbalance == 1.0  # the capacity caps the busiest rank
    a2a, a2a_even = (layer_comm(model, t, H100, "moe").ep[0] for t in (forced, even))
    latency = 2 * 7 * H100.intra_node_latency_s
    assert a2a - latency == pytest.approx((a2a_even - latency) * load)
    experts, experts_even = (WorkModel(model, t).layer("moe").forward for t in (forced, even))
    routed = [g for g in experts.gemms if g.groups == 8]
    assert routed and all(g.stretch == pytest.approx(load) for g in routed)
    assert experts.gemm_flops == pytest.approx(experts_even.gemm_flops)  # the FLOPs stay the shape's


def test_a_stretch_lengthens_a_grouped_gemm_by_its_share_without_tipping_tiles():
    gemm = Gemm(m=1024, n=5760, k=2880, groups=16)
    base = gemm_seconds(gemm, H100, "bf16")
    for factor in (1.0001, 1.005, 1.02):
        assert gemm_seconds(dataclasses.replace(gemm, stretch=factor), H100, "bf16") == pytest.approx(base * factor)
    grown = gemm_seconds(dataclasses.replace(gemm, m=1024 * 1.0001), H100, "bf16")
    assert grown > 1.05 * base  # a larger m adds a row of tiles to every expert: the step the stretch avoids


def test_deepseek_v3_at_ep_64_waits_for_a_busier_rank_than_qwen3_at_ep_8():
    """More ranks, fewer copies each: the busiest of 64 ranks is further above the mean."""
    dsv3, qwen = (load_model(EXAMPLES / "models" / f"{m}.yaml") for m in ("deepseek-v3", "qwen3-30b-a3b"))
    assert busiest_rank_load(dsv3, 64, 2048 * 64) > busiest_rank_load(qwen, 8, 4096 * 8) > 1
