"""Primus's forced balance is a round-robin, not megatron-core's random logits: token ``t`` of a rank goes to
experts ``t k`` ... ``t k + k - 1`` (mod E) (``PrimusTopKRouter.routing``, the Turbo DeepEP dispatcher's
``dispatch_preprocess``; ``moe_router_force_load_balancing_type: even``). Checked against the routes rebuilt as
Primus builds them: the ranks a token is sent to, the exact balance, and whether the experts' counts arrive aligned
for FP8; and that a Primus configuration reads as ``even`` unless it says otherwise."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from pathlib import Path

import pytest
import yaml

from primuspipe.projection.comm import Collectives, destination_ranks, layer_comm
from primuspipe.projection.framework import PrimusPipeError
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import read_arguments, read_megatron_config
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.spec_fields import spec_from_mapping
from primuspipe.projection.training_spec import RankShape, TrainingSpec

H100 = load_hardware(Path(__file__).resolve().parents[2] / "examples" / "projection" / "hardware" / "h100.yaml")


def _routes(tokens: int, k: int, experts: int) -> list[list[int]]:
    """Primus's forced routes on one rank: ``torch.arange(tokens * k).view(tokens, k) % experts``."""
    return [[(t * k + j) % experts for j in range(k)] for t in range(tokens)]


def _case(experts: int, k: int, ep: int, seq: int = 1024, **fields) -> tuple[ModelSpec, TrainingSpec]:
    model = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=seq, vocab_size=1000,
                      num_experts=experts, moe_router_topk=k)
    training = TrainingSpec(pipeline_model_parallel_size=1, expert_model_parallel_size=ep, data_parallel_size=ep,
                            global_batch_size=ep, moe_router_force_load_balancing=True,
                            moe_router_force_load_balancing_type="even", **fields)
    return model, training


CASES = [(experts, k, ep) for experts, k, ep in itertools.product((16, 60, 64, 160, 256), (2, 6, 8), (2, 4, 8))
         if experts % ep == 0 and k <= experts // ep * ep]


@pytest.mark.parametrize("experts,k,ep", CASES)
def test_even_forced_balance_sends_a_token_to_the_ranks_its_consecutive_experts_span(experts, k, ep):
    model, even = _case(experts, k, ep, moe_token_dispatcher_type="flex")
    per_rank = experts // ep
    tokens = experts * k  # whole periods of the starting expert
    spans = [len({e // per_rank for e in route}) for route in _routes(tokens, k, experts)]
    assert destination_ranks(model, even) == pytest.approx(sum(spans) / tokens)
    uniform = dataclasses.replace(even, moe_router_force_load_balancing_type="uniform")
    assert destination_ranks(model, even) <= destination_ranks(model, uniform) + 1e-9
    # the flex dispatcher's traffic follows the ranks: one copy per destination rank, not per expert
    node = H100  # the group inside one node
    plain = dataclasses.replace(even, moe_token_dispatcher_type="alltoall")
    a2a, flex = layer_comm(model, plain, node, "moe").ep[0], layer_comm(model, even, node, "moe").ep[0]
    latency = 2 * (ep - 1) * node.intra_node_latency_s
    assert flex - latency == pytest.approx((a2a - latency) * destination_ranks(model, even) / k)


@pytest.mark.parametrize("experts,k,ep", [(256, 8, 64), (256, 8, 16), (160, 6, 32), (64, 6, 16), (16, 2, 16)])
def test_across_nodes_the_flex_dispatcher_sends_a_round_robin_token_once_to_each_node_its_experts_span(experts, k, ep):
    model, even = _case(experts, k, ep, moe_token_dispatcher_type="flex")
    per_node = experts // (ep // H100.gpus_per_node)
    spans = [len({e // per_node for e in route}) for route in _routes(experts * k, k, experts)]  # whole periods
    shape = RankShape(model, even)
    rows = shape.residual_tokens * sum(spans) / len(spans) * model.hidden_size * shape.e
    assert layer_comm(model, even, H100, "moe").ep[0] == pytest.approx(2 * Collectives(H100).all_to_all(rows, ep, ep))
    # AutoModel's fake gate routes the same round-robin
    fake = dataclasses.replace(even, moe_router_force_load_balancing=False, fake_balanced_gate=True)
    assert layer_comm(model, fake, H100, "moe").ep == layer_comm(model, even, H100, "moe").ep
    uniform = dataclasses.replace(even, moe_router_force_load_balancing_type="uniform")
    assert layer_comm(model, even, H100, "moe").ep[0] <= layer_comm(model, uniform, H100, "moe").ep[0]


@pytest.mark.parametrize("experts,k,ep", CASES)
def test_even_forced_balance_is_exactly_balanced_where_random_logits_are_not(experts, k, ep):
    model, even = _case(experts, k, ep)
    tokens = int(RankShape(model, even).residual_tokens)
    load = Counter(e for route in _routes(tokens, k, experts) for e in route)
    per_rank = [sum(load[e] for e in range(r * experts // ep, (r + 1) * experts // ep)) for r in range(ep)]
    assert max(per_rank) - min(per_rank) <= experts // ep  # within one copy an expert: balanced
    assert RankShape(model, even).load_imbalance == 1.0
    uniform = dataclasses.replace(even, moe_router_force_load_balancing_type="uniform")
    assert RankShape(model, uniform).load_imbalance > 1.0


@pytest.mark.parametrize("seq,experts,k,ep", [(8192, 256, 8, 8), (4096, 160, 6, 8), (4096, 64, 6, 8),
                                              (4096, 128, 8, 8), (2048, 60, 4, 4), (1024, 16, 2, 2)])
def test_fp8_experts_copy_only_where_the_round_robins_counts_arrive_unaligned(seq, experts, k, ep):
    model, even = _case(experts, k, ep, seq=seq, fp8_format="hybrid", fp8_recipe="tensorwise")
    tokens = int(RankShape(model, even).residual_tokens)
    sent = Counter(e for route in _routes(tokens, k, experts) for e in route)  # one source rank's counts
    received = [ep * sent[e] for e in range(experts)]  # every source rank routes its tokens alike
    assert RankShape(model, even).fp8_padding_copies == any(n % even.fp8_alignment for n in received)
    uniform = dataclasses.replace(even, moe_router_force_load_balancing_type="uniform")
    assert RankShape(model, uniform).fp8_padding_copies  # random counts: some unaligned


def test_a_primus_configuration_balances_evenly_unless_it_says_otherwise(tmp_path):
    flags = "--num-experts 16 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-router-force-load-balancing "
    args = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1000 --micro-batch-size 1 --global-batch-size 16 --bf16 " + flags)
    assert read_arguments(args, "run.sh").training.moe_router_force_load_balancing_type == "uniform"  # megatron-core
    overrides = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 128,
                 "max_position_embeddings": 128, "vocab_size": 1000, "micro_batch_size": 1, "global_batch_size": 16,
                 "bf16": True, "num_experts": 16, "moe_router_topk": 2, "expert_model_parallel_size": 2,
                 "moe_router_force_load_balancing": True}
    exp = tmp_path / "exp.yaml"
    for stated, read in ((None, "even"), ("uniform", "uniform"), ("even", "even")):
        module = overrides | ({} if stated is None else {"moe_router_force_load_balancing_type": stated})
        exp.write_text(yaml.safe_dump({"modules": {"pre_trainer": {"framework": "megatron", "overrides": module}}}))
        training = read_megatron_config(exp).training
        assert training.moe_router_force_load_balancing_type == read
        assert training.round_robin_routing == (read == "even")
    with pytest.raises(PrimusPipeError, match="moe_router_force_load_balancing_type"):
        spec_from_mapping(TrainingSpec, {"moe_router_force_load_balancing_type": "random"}, "t.yaml")
