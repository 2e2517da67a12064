"""torchtitan's op-level selective activation checkpointing (``recompute_granularity: op``): the bytes a layer keeps,
by hand for Llama 3 8B and against what PyTorch's selective checkpoint really caches for a block of torchtitan's
shape run under torchtitan's policy on CPU; the recompute time; the refusals."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from primuspipe.projection.activations import ActivationModel, op_gemms
from primuspipe.projection.compute import Calibration, WorkModel, part_times
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.published import EXAMPLES
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec, check_compatible

LLAMA3_8B = load_model(EXAMPLES / "models" / "llama3-8b.yaml")
H100 = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
# torchtitan's 8B runs of its 2024-12 benchmark: FSDP 8, local batch 2, sequence 8192
TITAN = TrainingSpec(micro_batch_size=2, global_batch_size=16, pipeline_model_parallel_size=1, data_parallel_size=8,
                     recompute_granularity="op")


def test_the_policy_saves_every_other_gemm_of_a_llama_block():
    assert [name for name, *_, saved in op_gemms(swiglu=True) if saved] == ["wq", "wv", "w1", "w2"]
    assert [name for name, *_, saved in op_gemms(swiglu=False) if saved] == ["wq", "wv", "w1"]


def test_llama3_8b_layer_bytes_by_hand():
    tokens = 2 * 8192
    # input, wq, wv, attention output (4096 x bf16 each but wv's 1024), 32 heads' fp32 log-sum-exp, w1 (14336)
    compiled = tokens * (2 * (4096 + 4096 + 1024 + 4096 + 14336) + 32 * 4)
    assert compiled == 908_066_816
    eager = compiled + tokens * 4096 * 2  # and w2's output, which only the eager cache keeps
    kept = ActivationModel(LLAMA3_8B, TITAN).layer_bytes(range(32))
    assert kept == [eager] * 32
    compiled_kept = ActivationModel(LLAMA3_8B, dataclasses.replace(TITAN, op_recompute_compiled=True))
    assert compiled_kept.layer_bytes(range(32)) == [compiled] * 32
    # the block's recompute rebuilds, for one layer at a time, what it did not keep
    plain = ActivationModel(LLAMA3_8B, dataclasses.replace(TITAN, recompute_granularity=None))
    assert compiled_kept.recompute_working_set(range(32)) == plain.layer_bytes(range(1))[0] - compiled


def test_tensor_and_sequence_parallel_keep_the_reduce_scatters_and_w2s_partial_sums():
    # torchtitan's 2025-06 async-TP benchmark: FSDP 8 x TP 8, local batch 12
    tp = dataclasses.replace(TITAN, micro_batch_size=12, global_batch_size=96, tensor_model_parallel_size=8,
                             sequence_parallel=True)
    tokens = 12 * 8192
    # per token: input 512, wq 512, wv 128, attention 512 (bf16), log-sum-exp 4 heads fp32, wo's reduce-scatter 512,
    # w1 1792 (bf16); eager also w2's partial sums over all tokens (4096) and their reduce-scatter (512)
    compiled = tokens * (2 * (512 + 512 + 128 + 512 + 512 + 1792) + 4 * 4)
    eager = compiled + tokens * 2 * (4096 + 512)
    assert ActivationModel(LLAMA3_8B, tp).layer_bytes(range(1)) == [eager]
    assert ActivationModel(LLAMA3_8B, dataclasses.replace(tp, op_recompute_compiled=True)).layer_bytes(range(1)) == [
        compiled]


def test_recompute_time_lies_between_nothing_and_the_whole_forward():
    times = part_times(WorkModel(LLAMA3_8B, TITAN), H100, Calibration())["dense"]
    assert 0 < times.recompute < times.forward
    # wk, wo and w3: (1024 + 4096 + 14336) of the block's (4096 + 2 x 1024 + 4096 + 3 x 14336) weight columns of 4096
    work = WorkModel(LLAMA3_8B, TITAN).layer("dense")
    flops = sum(2 * g.m * g.n * g.k for g in work.recompute.gemms)
    assert flops == pytest.approx(19456 / 53248 * sum(2 * g.m * g.n * g.k for g in work.forward.gemms))
    assert times.recompute > 0.3 * times.forward


def test_op_recompute_outside_torchtitans_llama_block_is_refused():
    moe = load_model(EXAMPLES / "models" / "mixtral-8x7b.yaml")
    with pytest.raises(InputError, match="op recompute"):
        check_compatible(moe, dataclasses.replace(TITAN, expert_model_parallel_size=8))
    with pytest.raises(InputError, match="op recompute"):
        check_compatible(LLAMA3_8B, dataclasses.replace(TITAN, context_parallel_size=2, data_parallel_size=4))
    with pytest.raises(InputError, match="op_recompute_compiled"):
        TrainingSpec(recompute_granularity="selective", op_recompute_compiled=True)


# -- against PyTorch's own selective checkpoint ------------------------------------------------------------------

SMALL = ModelSpec(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                  kv_channels=8, seq_length=32, vocab_size=256, swiglu=True, normalization="RMSNorm",
                  add_bias_linear=False, position_embedding_type="rope")
"""Heads' width (32) unlike the hidden size (64) and grouped keys (16), so every GEMM's output has its own size."""


def _titan_block(torch, model: ModelSpec):
    """A block shaped as torchtitan's Llama TransformerBlock: separate wq / wk / wv, SDPA, wo; w2(silu(w1) * w3)."""
    nn, F = torch.nn, torch.nn.functional
    h, d, heads, groups = model.hidden_size, model.head_dim, model.num_attention_heads, model.query_groups

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk = nn.Linear(h, heads * d, bias=False), nn.Linear(h, groups * d, bias=False)
            self.wv, self.wo = nn.Linear(h, groups * d, bias=False), nn.Linear(heads * d, h, bias=False)
            self.w1, self.w3 = nn.Linear(h, model.ffn, bias=False), nn.Linear(h, model.ffn, bias=False)
            self.w2 = nn.Linear(model.ffn, h, bias=False)
            self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)

        def attention(self, x):
            b, s, _ = x.shape
            q = self.wq(x).view(b, s, heads, d) * 0.5  # an element-wise op standing for the rotary embedding
            k = self.wk(x).view(b, s, groups, d) * 0.5
            v = self.wv(x).view(b, s, groups, d)
            k, v = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(b, s, heads * d))

        def forward(self, x):
            h_ = x + self.attention(self.attention_norm(x))
            y = self.ffn_norm(h_)
            return h_ + self.w2(F.silu(self.w1(y)) * self.w3(y))

    return Block()


def test_kept_bytes_match_what_torch_selective_checkpoint_caches():
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    ops = torch.ops.aten
    # torchtitan's _save_list; on CPU SDPA's flash path is the _for_cpu op, standing for the CUDA one
    save = {ops.mm.default, ops._scaled_dot_product_flash_attention.default,
            ops._scaled_dot_product_flash_attention_for_cpu.default, ops.max.default}
    made = []

    def context():
        meta = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):  # torchtitan's rule: every second mm is recomputed
            key = "recompute" if ctx.is_recompute else "forward"
            if func == ops.mm.default:
                meta[key] += 1
            keep = func in save and not (func == ops.mm.default and meta[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        made.append(create_selective_checkpoint_contexts(policy))
        return made[-1]

    torch.manual_seed(0)
    block = _titan_block(torch, SMALL).to(torch.bfloat16)
    x = torch.randn(2, SMALL.seq_length, SMALL.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False, context_fn=context)
    cached = [w for entries in made[0][0].storage.values() for value in entries.values()
              for w in (value if isinstance(value, tuple) else (value,))]  # an op's outputs, each wrapped
    tensors = [w.val for w in cached if isinstance(getattr(w, "val", None), torch.Tensor)]
    assert len(tensors) == 6  # wq, wv, w1, w2; the attention's output and log-sum-exp
    kept = x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in tensors)
    training = TrainingSpec(micro_batch_size=2, pipeline_model_parallel_size=1, recompute_granularity="op")
    assert ActivationModel(SMALL, training).layer_bytes(range(1)) == [kept]
    out.sum().backward()  # the recompute replays against the cache
    assert x.grad is not None
