"""TE deferral against REAL Transformer Engine on a CUDA GPU (skipped without CUDA or TE; run by
bench/gpu_te.sh). The same contract the CPU tests check against the stand-in:

* real TE modules (Linear with and without bias / return_bias, LayerNormLinear, LayerNormMLP,
  GroupedLinear) built with ``delay_wgrad_compute=True``, driven by :class:`TEDeferral` in B/W orders a
  zero-bubble table produces (B B B W W W, interleaved, fused BW), give gradients bitwise equal to the
  same modules without deferral, in bf16, with ``fuse_wgrad_accumulation`` into fp32 ``main_grad``
  (Megatron's setting: microbatch 0 overwrites it) and, where the GPU supports it, under FP8;
* a megatron-core GPT built with Megatron's TE layer spec, trained one step by primuspipe's zero-bubble
  table with deferral, equals Megatron's own schedule without it (losses and main_grads bitwise).
"""

import contextlib
import importlib.util
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

te = pytest.importorskip("transformer_engine.pytorch") if torch.cuda.is_available() else None

from primuspipe.backends.megatron.te_deferral import TEDeferral  # noqa: E402

H, FFN, TOKENS = 64, 128, 32
ORDERS = ("B0 B1 B2 W0 W1 W2", "B0 W0 B1 B2 W1 W2", "BW0 B1 W1 BW2")


def _fp8_ok():
    available = getattr(te, "is_fp8_available", None) or te.fp8.check_fp8_support
    result = available()
    return result[0] if isinstance(result, tuple) else bool(result)


def _autocast(fp8):
    if not fp8:
        return contextlib.nullcontext()
    from transformer_engine.common.recipe import DelayedScaling

    return te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling())


def _build(kind, defer, fuse):
    kwargs = dict(params_dtype=torch.bfloat16, device="cuda", delay_wgrad_compute=defer,
                  fuse_wgrad_accumulation=fuse)
    torch.manual_seed(0)
    if kind == "linear":
        return te.Linear(H, H, bias=True, **kwargs)
    if kind == "linear-return-bias":
        return te.Linear(H, H, bias=True, return_bias=True, **kwargs)
    if kind == "layernorm-linear":
        return te.LayerNormLinear(H, H, bias=False, **kwargs)
    if kind == "layernorm-mlp":
        return te.LayerNormMLP(H, FFN, bias=False, **kwargs)
    return te.GroupedLinear(2, H, H, bias=False, **kwargs)


def _run(kind, module, x, first):
    if kind == "grouped":
        try:
            out = module(x, [TOKENS // 2, TOKENS // 2], is_first_microbatch=first)
        except TypeError:  # newer TE takes m_splits as a tensor
            out = module(x, torch.tensor([TOKENS // 2, TOKENS // 2]), is_first_microbatch=first)
    else:
        out = module(x, is_first_microbatch=first)
    return sum(out) if isinstance(out, tuple) else out


def _grads(kind, defer, fuse, fp8, order):
    """name -> gradient summed in fp32 as Megatron DDP sums it: parameters TE hooks through backward_dw
    (``skip_backward_post_hook``) when backward_dw's hooks run, the others when autograd accumulates them."""
    module = _build(kind, defer, fuse)
    named = dict(module.named_parameters())
    acc = {}
    if fuse:
        for p in named.values():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")

    def consume(name):
        p = named[name]
        if p.grad is not None:
            acc[name] = p.grad.float() if name not in acc else acc[name] + p.grad.float()
            p.grad = None

    deferred = [n for n, p in named.items() if getattr(p, "skip_backward_post_hook", False)]
    for name, p in named.items():
        if name not in deferred:
            p.register_post_accumulate_grad_hook(lambda _, name=name: consume(name))
    deferral = None
    if defer:
        module.register_wgrad_accumulation_and_reduce_hooks(lambda: [consume(n) for n in deferred])
        deferral = TEDeferral([[("module", module)]])
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    for step in order.split():
        mb = int(step[-1])
        if step.startswith("B"):
            with _autocast(fp8):
                out = _run(kind, module, inputs[mb], mb == 0)
            with deferral.collecting(0, mb) if deferral else contextlib.nullcontext():
                out.float().square().mean().backward()
        if deferral and step.startswith(("W", "BW")):
            deferral.flush(0, mb)
    if deferral:
        deferral.check_empty()
    return {n: acc[n] if n in acc else p.main_grad.clone() for n, p in named.items()}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("kind", ["linear", "linear-return-bias", "layernorm-linear", "layernorm-mlp", "grouped"])
@pytest.mark.parametrize("order", ORDERS)
def test_real_te_deferral_is_bitwise_equal_to_te_without_it(kind, fuse, fp8, order):
    """Bitwise, except bias gradients TE computes in B (return_bias, FP8): autograd sums two microbatches'
    in bf16 before a W's hook moves them, a different grouping than per-microbatch (as in Megatron)."""
    if fp8 and not _fp8_ok():
        pytest.skip("this GPU has no FP8")
    want = _grads(kind, False, fuse, fp8, " ".join(f"B{mb}" for mb in range(3)))
    got = _grads(kind, True, fuse, fp8, order)
    assert got.keys() == want.keys()
    for name, w in want.items():
        if "bias" in name and (kind == "linear-return-bias" or fp8):
            torch.testing.assert_close(got[name], w, rtol=1e-2, atol=1e-2, msg=name)
        else:
            assert torch.equal(got[name], w), f"{name}: max diff {(got[name] - w).abs().max().item()}"


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.parametrize("algorithm", ["zb-h1", "1f1b"])
def test_megatron_te_gpt_matches_megatron_without_deferral(algorithm):
    """pp=1 on one GPU: primuspipe's table (F B W per microbatch) with TE deferral vs Megatron's
    no-pipelining schedule without it; megatron-core GPT with its Transformer Engine layer spec."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from primuspipe.backends.megatron.config import PrimusPipeConfig
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.backends.megatron.te_deferral import enable_delay_wgrad_compute
    from primuspipe.testing.megatron import compare, tiny_models

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29524")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_config = tiny_models.TinyModelConfig(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                               seq_length=32, num_layers=2)

    def step(schedule, defer):
        config = tiny_models.transformer_config(model_config, 1, 1, params_dtype=torch.bfloat16, bf16=True,
                                                pipeline_dtype=torch.bfloat16, use_cpu_initialization=False,
                                                gradient_accumulation_fusion=True)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        if defer:
            enable_delay_wgrad_compute(config, ddp_config)
        model_parallel_cuda_manual_seed(0)
        torch.manual_seed(0)
        gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                       vocab_size=model_config.vocab_size, max_sequence_length=model_config.seq_length,
                       pre_process=True, post_process=True, share_embeddings_and_output_weights=False,
                       position_embedding_type="learned_absolute").cuda().bfloat16()
        model = DistributedDataParallel(config, ddp_config, gpt)
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        model.zero_grad_buffer()
        spec = compare.StepSpec(model_config, 4, ddp=True)
        losses, _ = compare.call_schedule(schedule, spec, [model], torch.device("cuda"))
        return losses, compare.param_grads([gpt], ddp=True)

    try:
        want_losses, want = step(get_forward_backward_func(), False)
        got_losses, got = step(PrimusForwardBackward(PrimusPipeConfig(True, algorithm)), True)
    finally:
        parallel_state.destroy_model_parallel()
    assert len(got_losses) == len(want_losses) == 4
    assert all(torch.equal(a["lm loss"], b["lm loss"]) for a, b in zip(got_losses, want_losses))
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name}: max diff {(got[name] - w).abs().max().item()}"
