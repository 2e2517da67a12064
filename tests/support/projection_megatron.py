"""Real megatron-core models for the projection tests: parameter counts per pipeline rank (built on
the meta device under a fake process group, so any TP/PP/EP layout fits in one process) and saved
activation bytes of one layer forward (counted with ``saved_tensors_hooks``)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed, enable_cpu_mode


@contextlib.contextmanager
def fake_parallel_state(training, rank: int = 0):
    """Megatron's ``parallel_state`` for the training spec's layout, as seen by global ``rank``, without
    any real communication (torch's ``fake`` backend)."""
    enable_cpu_mode()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=training.world_size, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=training.tp, pipeline_model_parallel_size=training.pp,
            virtual_pipeline_model_parallel_size=training.vpp if training.vpp > 1 else None,
            context_parallel_size=training.cp, expert_model_parallel_size=training.ep,
            expert_tensor_parallel_size=training.etp, create_gloo_process_groups=False)
        cpu_rng_seed(0)
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class _ParameterFreeAttention(torch.nn.Module):
    """Stands in for core attention, which has no parameters, where the local spec cannot build it."""

    def __init__(self, *args, **kwargs):
        super().__init__()


class _NormThenLinear(torch.nn.Module):
    """The local equivalent of Transformer Engine's fused norm + column-parallel linear (its parameters:
    the norm's and the linear's)."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        super().__init__()
        self.layer_norm = WrappedTorchNorm(config=config, hidden_size=input_size)
        self.linear = ColumnParallelLinear(input_size, output_size, config=config, **kwargs)


@contextlib.contextmanager
def _mla_local_spec(model):
    """MLA through megatron-core 0.19's local spec, for parameter counts only. Its ``DotProductAttention``
    does not take MLA's separate key width (``k_channels``), so core attention (parameter-free) is a
    stand-in; and with ``qk_layernorm`` but no ``q_lora_rank``, Megatron puts the query norm into a
    fused norm + linear query projection, which only Transformer Engine provides: :class:`_NormThenLinear`
    plays it (and the local spec's separate query norm, which Megatron would reject, is ignored)."""
    from unittest import mock

    if not model.multi_latent_attention:
        yield
        return
    with mock.patch("megatron.core.models.backends.LocalSpecProvider.core_attention",
                    lambda self: _ParameterFreeAttention), \
            mock.patch("megatron.core.models.backends.LocalSpecProvider.column_parallel_layer_norm_linear",
                       lambda self: _NormThenLinear), \
            mock.patch("megatron.core.transformer.mla_qk_norm_config.QKNormConfigResolver._raise_unused_q_norm",
                       lambda self: None):
        yield


def megatron_rank_chunks(model, training, stage_counts):
    """Per pipeline rank (TP/EP rank 0), the model chunks megatron-core builds for it, on the meta device."""
    from unittest import mock

    from primuspipe.projection.benchmark.megatron_model import build_gpt_chunk, transformer_config

    pp, vpp = training.pp, training.vpp
    for rank in range(pp):
        with fake_parallel_state(training, rank=rank * training.tp * training.cp * training.dp):
            config = transformer_config(model, training, stage_counts=stage_counts, initialize=False)
            chunks = []
            for vp in range(vpp):
                stage = vp * pp + rank
                # tied embeddings with pp > 1 move the output weight copy to CUDA at build time, and MLA's
                # rotary table asks for the current CUDA device
                with torch.device("meta"), mock.patch.object(torch.Tensor, "cuda", lambda t, *a, **k: t), \
                        mock.patch("torch.cuda.current_device", lambda: "cpu"), _mla_local_spec(model):
                    chunks.append(build_gpt_chunk(model, training, config, vp_stage=vp if vpp > 1 else None,
                                                  pre_process=stage == 0, post_process=stage == pp * vpp - 1))
        yield chunks


def megatron_rank_params(model, training, stage_counts) -> list[int]:
    """Parameters megatron-core allocates on each pipeline rank (TP/EP rank 0), all chunks together."""
    return [sum(p.numel() for chunk in chunks for p in chunk.parameters())
            for chunks in megatron_rank_chunks(model, training, stage_counts)]


@contextlib.contextmanager
def cpu_checkpointing():
    """Megatron's activation checkpointing snapshots CUDA RNG states; on CPU the CPU generator's state
    stands in (dropout is still reproduced, from the CPU generator)."""
    from unittest import mock

    with mock.patch("megatron.core.tensor_parallel.random._get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()), \
            mock.patch("megatron.core.tensor_parallel.random._set_cuda_rng_state", lambda *a, **k: None):
        yield


def saved_bytes(module: torch.nn.Module, run, *, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` does a forward through ``module``:
    a tensor saved twice, or a view of a saved storage, counts once (what stays alive); parameters,
    buffers and the tensors in ``exclude`` (constant inputs such as the attention mask) are not
    activations."""
    skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers(), *exclude)}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    del output
    return sum(seen.values())


def block_saved_bytes(model, training, kinds) -> int:
    """Saved bytes of one microbatch through a ``TransformerBlock`` of layers of ``kinds`` (the training
    spec's precision, recompute and kernels), on CPU."""
    enable_cpu_mode()
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from primuspipe.projection.benchmark.megatron_model import (
        DTYPES, causal_mask, layer_spec, rotary_embedding, transformer_config)

    whole = dataclasses.replace(training, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=1)
    with fake_parallel_state(whole), cpu_checkpointing():
        config = transformer_config(model, training, num_layers=len(kinds))
        spec = TransformerBlockSubmodules(layer_specs=[layer_spec(model, k) for k in kinds])
        block = TransformerBlock(config, spec, post_layer_norm=False).to(DTYPES[training.precision])
        tokens = model.seq_length // training.cp
        x = torch.randn(tokens, training.micro_batch_size, model.hidden_size, dtype=DTYPES[training.precision],
                        requires_grad=True)
        mask, rope = causal_mask(tokens), rotary_embedding(model, training)
        extra = [mask] if rope is None else [mask, rope]
        return saved_bytes(block, lambda: block(x, attention_mask=mask, rotary_pos_emb=rope), exclude=extra)


def model_saved_bytes(model, training) -> int:
    """Saved bytes of one microbatch through the whole model (one pipeline stage: embedding, every
    layer, final norm, output layer and the vocab-parallel cross entropy), on CPU."""
    from primuspipe.projection.benchmark.megatron_model import DTYPES, build_gpt_chunk, causal_mask, transformer_config

    whole = dataclasses.replace(training, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=1)
    with fake_parallel_state(whole), cpu_checkpointing(), _host_rotary_tables():
        config = transformer_config(model, whole)
        gpt = build_gpt_chunk(model, whole, config, vp_stage=None, pre_process=True, post_process=True)
        gpt = gpt.to(DTYPES[training.precision])
        b, s = training.micro_batch_size, model.seq_length
        tokens = torch.randint(model.padded_vocab(1), (b, s))
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = causal_mask(s)
        return saved_bytes(gpt, lambda: gpt(tokens, positions, mask, labels=tokens), exclude=[mask])


@contextlib.contextmanager
def _host_rotary_tables():
    """GPTModel's rotary embedding moves its table to the current CUDA device; keep it on the host."""
    from unittest import mock

    with mock.patch("torch.cuda.current_device", lambda: "cpu"):
        yield


def megatron_dense_buffers(model, training, stage_counts) -> list[tuple[int, int, int]]:
    """Per pipeline rank (TP/EP rank 0, all chunks): what megatron-core's DDP would put in the BF16 buffer beside
    FP8 weights, as (its parameters, the GEMM weight tensors, its tensors) -- read off the built model: a GEMM weight
    is the ``weight`` of a tensor-parallel linear other than the output layer, which, like the embedding, the norms
    and the router, Transformer Engine's FP8 weights leave alone. Routed experts are left out (their own buffers)."""
    enable_cpu_mode()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    buffers = []
    for chunks in megatron_rank_chunks(model, training, stage_counts):
        unquantized = weights = others = 0
        for chunk in chunks:
            modules = dict(chunk.named_modules())
            for name, param in chunk.named_parameters():
                owner, _, leaf = name.rpartition(".")
                if ".experts." in name and ".shared_experts." not in name:
                    continue
                if leaf == "weight" and isinstance(modules[owner], (ColumnParallelLinear, RowParallelLinear)) \
                        and not owner.endswith("output_layer"):
                    weights += 1
                else:
                    unquantized, others = unquantized + param.numel(), others + 1
        buffers.append((unquantized, weights, others))
    return buffers
