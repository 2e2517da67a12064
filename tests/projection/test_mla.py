"""MLA's element-wise work besides its GEMMs: the rotary slice, the query/key assembly and the value copy, fused and
unfused, held against megatron-core's own rotary function (bytes its aten ops read and write on CPU) and against the
per-head widths of DeepSeek-V3 counted by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from primuspipe.projection.compute import WorkModel
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"


def _bytes_moved(run) -> int:
    """HBM bytes a function's aten ops read and write: every tensor argument and result of each op that makes a
    new tensor (views move nothing)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
                Moved.total += sum(x.numel() * x.element_size() for x in tensors)
            return out

    with Moved():
        run()
    return Moved.total


def test_the_unfused_mla_rotary_moves_each_rotary_element_fourteen_times():
    """megatron-core's ``_apply_rotary_pos_emb_bshd`` with ``mla_rotary_interleaved`` (the unfused path of
    ``MLASelfAttention``) on a query's rotary slice: 14 element reads and writes per element."""
    import torch

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    seq, heads, rope = 256, 64, 64
    t = torch.randn(seq, 1, heads, rope, dtype=torch.bfloat16)
    freqs = torch.randn(seq, 1, 1, rope)  # the cos/sin tables: one row per position, shared by the heads
    moved = _bytes_moved(lambda: _apply_rotary_pos_emb_bshd(t, freqs, mla_rotary_interleaved=True))
    tables = 8 * seq * rope * 4  # cos and sin of the table (fp32) and their casts, a share 1/heads of the rest
    assert (moved - tables) / t.numel() / t.element_size() == pytest.approx(14, rel=0.05)


def test_mla_elementwise_work_counts_its_heads_widths():
    model = load_model(EXAMPLES / "models" / "deepseek-v3.yaml")
    fused = TrainingSpec(pipeline_model_parallel_size=1, global_batch_size=1, micro_batch_size=1)
    unfused = dataclasses.replace(fused, apply_rope_fusion=False)
    tokens, heads = 4096, 128
    latents = 2 * tokens * (1536 + 512)
    # fused: the query's 64 rotary values in place, kv (256) read, key (192) and value (128) written
    assert WorkModel(model, fused)._mla_elements() == latents + tokens * (heads * (128 + 256 + 192 + 128) + 64)
    # unfused: 14 passes over 64 rotary values, the query and key concatenated (192 each way), the value copied
    assert WorkModel(model, unfused)._mla_elements() == latents + tokens * (heads * (896 + 384 + 384 + 256) + 14 * 64)
    # the layer's forward moves those bytes beside the rest of its element-wise work, at bf16
    extra = (WorkModel(model, unfused)._mla_elements() - WorkModel(model, fused)._mla_elements()) * 2
    forward = [WorkModel(model, t).layer("moe").forward.memory_bytes for t in (fused, unfused)]
    assert forward[1] - forward[0] == pytest.approx(extra)
    # MLA's heads are its own widths: kv_channels (the GQA head dimension) changes nothing
    wide = dataclasses.replace(model, kv_channels=128)
    assert WorkModel(wide, fused)._mla_elements() == WorkModel(model, fused)._mla_elements()
    # TP splits the heads; with sequence parallelism the latents (and the down-projections) see 1/TP of the tokens
    tp2 = dataclasses.replace(fused, tensor_model_parallel_size=2, sequence_parallel=True)
    assert WorkModel(model, tp2)._mla_elements() == latents / 2 + tokens * (heads / 2 * (128 + 256 + 192 + 128) + 64)
    down = [g for g in WorkModel(model, tp2)._attention_projections()[0].forward.gemms if g.n in (1536, 576)]
    assert sorted((g.m, g.n, g.k) for g in down) == [(2048, 576, 7168), (2048, 1536, 7168)]


def test_mla_up_proj_recompute_repeats_the_rotary_and_assembly_not_the_latent_norms():
    """megatron-core checkpoints ``qkv_up_proj_and_rope_apply`` (the up-projections, the rotary embedding and the
    query/key/value assembly) after the latent norms: B repeats those, at bf16."""
    model = load_model(EXAMPLES / "models" / "deepseek-v3.yaml")
    for fusion in (True, False):
        plain = TrainingSpec(pipeline_model_parallel_size=1, global_batch_size=1, apply_rope_fusion=fusion)
        up = dataclasses.replace(plain, recompute_granularity="selective", recompute_modules=("mla_up_proj",))
        work = WorkModel(model, up)
        recompute = work.layer("moe").recompute
        gemms = WorkModel(model, plain)._attention_projections()[1].forward
        assert recompute.gemm_flops == pytest.approx(gemms.gemm_flops)
        latents = 2 * 4096 * (1536 + 512)
        assert recompute.memory_bytes == pytest.approx((work._mla_elements() - latents) * 2 + gemms.memory_bytes)


def test_mla_flash_backward_counts_its_five_products_at_their_widths():
    """A fused attention backward recomputes ``Q K^T`` and runs ``dP = dO V^T``, ``dV = P^T dO``, ``dQ = dS K``,
    ``dK = dS^T Q``: ``3 d_qk + 2 d_v`` against the forward's ``d_qk + d_v``, 2.6 forwards at DeepSeek-V3's 192 / 128
    (cudnn-frontend's SDPA benchmark counts it so), where equal widths give 2.5."""
    model = load_model(EXAMPLES / "models" / "deepseek-v3.yaml")
    layer = WorkModel(model, TrainingSpec(pipeline_model_parallel_size=1, global_batch_size=1)).layer("moe")
    tokens, heads = 4096, 128
    causal = 0.5 * 2 * tokens * tokens * heads * (192 + 128)
    assert layer.forward.attention_flops == pytest.approx(causal)
    assert layer.backward_input.attention_flops == pytest.approx(2 * tokens * tokens * heads * (3 * 192 + 2 * 128) / 2)
    assert layer.backward_input.attention_flops / layer.forward.attention_flops == pytest.approx(2.6)
