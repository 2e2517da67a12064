"""torchtitan's Llama code as the projection prices it: its eager element-wise ops (``elementwise_kernels:
torchtitan-eager``) and its separate linears under DTensor tensor parallelism (``model_implementation:
torchtitan``), each held against what the real PyTorch ops do."""

from __future__ import annotations

import dataclasses
import re

import pytest
from aten_bytes import byte_counter

from published_rows import shipped_runs
from primuspipe.projection.activations import ActivationModel
from primuspipe.projection.comm import layer_comm
from primuspipe.projection.compute import WorkModel
from primuspipe.projection.compute.elementwise import EAGER_RMSNORM_BYTES, EAGER_ROPE_BYTES, EAGER_SWIGLU_BYTES
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.training_spec import TrainingSpec

MODEL = ModelSpec(num_layers=4, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=8, num_query_groups=2,
                  seq_length=2048, vocab_size=32000, make_vocab_size_divisible_by=128, swiglu=True,
                  add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True)
UNFUSED = TrainingSpec(micro_batch_size=2, global_batch_size=16, bias_activation_fusion=False, apply_rope_fusion=False)
EAGER = dataclasses.replace(UNFUSED, elementwise_kernels="torchtitan-eager")
HW = HardwareSpec(name="test", peak_bf16_tflops=100.0, achievable_fraction=0.5, hbm_bytes=80e9,
                  hbm_bandwidth_bytes_per_s=2e12, memory_bandwidth_fraction=0.5, intra_node_bandwidth_bytes_per_s=100e9,
                  inter_node_bandwidth_bytes_per_s=10e9, intra_node_latency_s=1e-5, inter_node_latency_s=2e-5,
                  network_efficiency=1.0, gpus_per_node=8)


def _moved(forward) -> tuple[float, float]:
    """Bytes ``forward()`` and the backward of its output dispatch, as aten operations see them."""
    import torch

    Moved = byte_counter()
    f, b = Moved(), Moved()
    with f:
        out = forward()
    grad = torch.randn_like(out)
    with b:
        out.backward(grad)
    return f.bytes, b.bytes


def test_torchtitan_eager_ops_move_what_their_aten_operations_move():
    """torchtitan's RMSNorm (norms.py at 9dec370), ``F.silu(w1(x)) * w3(x)`` and complex-number rotary
    (llama/model.py), run eager on bf16 tensors: the bytes per element the work model prices are what their aten
    operations and autograd's move (the per-row statistics and the frequency table aside)."""
    import torch

    rows, width = 64, 256
    x = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(width, dtype=torch.bfloat16, requires_grad=True)

    def rmsnorm():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight

    gate = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(rows, width, dtype=torch.bfloat16, requires_grad=True)
    query = torch.randn(2, 16, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.polar(torch.ones(16, 32), torch.randn(16, 32)).view(1, 16, 1, 32)

    def rotary():
        complex_query = torch.view_as_complex(query.float().reshape(2, 16, 32, 32, 2))
        return torch.view_as_real(complex_query * freqs).flatten(3).type_as(query)

    for (forward, inputs), figures in (((rmsnorm, x), EAGER_RMSNORM_BYTES),
                                       ((lambda: torch.nn.functional.silu(gate) * up, gate), EAGER_SWIGLU_BYTES),
                                       ((rotary, query), EAGER_ROPE_BYTES)):
        f, b = _moved(forward)
        assert f / inputs.numel() == pytest.approx(figures[0], rel=0.03)
        assert b / inputs.numel() == pytest.approx(figures[1], rel=0.03)


def test_eager_elementwise_work_replaces_the_fused_kernels_in_f_and_b_only():
    """The layer's two norms, its SwiGLU and its rotary move the eager chains' bytes instead of the fused kernels'
    (and megatron-core's unfused rotary); GEMMs and W are untouched; the default changes nothing."""
    fused, eager = WorkModel(MODEL, UNFUSED).layer("dense"), WorkModel(MODEL, EAGER).layer("dense")
    tokens, h, f = 2 * 2048, MODEL.hidden_size, MODEL.ffn
    qk = tokens * (8 + 2) * MODEL.head_dim
    forward = 2 * tokens * h * (36 - 4) + tokens * f * (10 - 6) + qk * (20 - 24)
    backward = 2 * tokens * h * (96 - 6) + tokens * f * (18 - 10) + qk * (20 - 28)
    assert eager.forward.memory_bytes - fused.forward.memory_bytes == pytest.approx(forward)
    assert eager.backward_input.memory_bytes - fused.backward_input.memory_bytes == pytest.approx(backward)
    assert eager.forward.gemms == fused.forward.gemms and eager.backward_weight == fused.backward_weight
    head = WorkModel(MODEL, EAGER).head().forward.memory_bytes - WorkModel(MODEL, UNFUSED).head().forward.memory_bytes
    assert head == pytest.approx(tokens * h * (36 - 4))  # the final norm
    layernorm = dataclasses.replace(MODEL, normalization="LayerNorm")  # eager nn.LayerNorm is one kernel
    assert (WorkModel(layernorm, EAGER).head().forward.memory_bytes
            == WorkModel(layernorm, UNFUSED).head().forward.memory_bytes)


def test_torchtitan_rotary_is_its_complex_chain_under_compile_too():
    """torchtitan's rotary multiplies complex numbers, which inductor leaves to aten kernels (it generates no code for
    complex operators): compiled (``apply_rope_fusion`` left on, norms and SwiGLU fused) its layer moves the eager
    chain's bytes for the queries and keys where megatron-core's fused kernel moves 2 + 2 each way."""
    import torch
    from torch._inductor.lowering import unsupported_input_tensor

    with pytest.warns(UserWarning, match="complex operators"):
        assert unsupported_input_tensor(torch.empty(4, dtype=torch.complex64))
    mega = TrainingSpec(micro_batch_size=2, global_batch_size=16)
    titan = dataclasses.replace(mega, model_implementation="torchtitan")
    qk = 2 * 2048 * (8 + 2) * MODEL.head_dim
    a, b = WorkModel(MODEL, mega).layer("dense"), WorkModel(MODEL, titan).layer("dense")
    assert b.forward.memory_bytes - a.forward.memory_bytes == pytest.approx(qk * (EAGER_ROPE_BYTES[0] - 4))
    backward = b.backward_input.memory_bytes - a.backward_input.memory_bytes
    assert backward == pytest.approx(qk * (EAGER_ROPE_BYTES[1] - 4))


@pytest.mark.parametrize("change", [{"bias_activation_fusion": True}, {"apply_rope_fusion": True},
                                    {"precision": "fp32"}])
def test_eager_elementwise_needs_unfused_bf16_ops(change):
    with pytest.raises(InputError, match="eager element-wise"):
        dataclasses.replace(EAGER, **change)


def test_torchtitan_linears_run_as_separate_gemms_of_the_same_flops():
    """wq, wk, wv and w1, w3: five GEMMs where megatron-core runs two, the FLOPs the same in every pass."""
    for tp in (1, 2):
        mega = TrainingSpec(micro_batch_size=2, global_batch_size=16, tensor_model_parallel_size=tp)
        titan = dataclasses.replace(mega, model_implementation="torchtitan")
        a, b = WorkModel(MODEL, mega).layer("dense"), WorkModel(MODEL, titan).layer("dense")
        for x, y in zip(a.passes(), b.passes()):
            assert len(y.gemms) == len(x.gemms) + 3
            assert y.gemm_flops == pytest.approx(x.gemm_flops)
        kv = 2 * MODEL.head_dim / tp  # two query groups' keys
        assert sorted(g.n for g in b.forward.gemms)[:2] == [kv, kv]


def _dtensor_run() -> tuple[list[int], list[str]]:
    import torch.multiprocessing as mp
    from dtensor_probe import probe

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(probe, args=(2, 29000 + __import__("os").getpid() % 1000, results), nprocs=2, join=True)
    return results.get()


def test_dtensor_tensor_parallelism_saves_the_gathered_input_and_gathers_nothing_in_backward():
    """On two ranks, torchtitan's plan for the attention's input (sequence-parallel norm, Shard(1) -> Replicate,
    column-parallel wq, wk, wv): each linear saves the gathered 16 rows (not its rank's 8), and the backward runs
    only the reduce-scatter of the input gradient -- no all-gather. The projection: no W re-gather and the gathered
    inputs kept, unless the norms are recomputed (op SAC's policy re-gathers)."""
    rows, collectives = _dtensor_run()
    assert rows == [16, 16, 16]
    assert collectives == ["reduce_scatter_tensor"]
    mega = TrainingSpec(micro_batch_size=2, global_batch_size=16, tensor_model_parallel_size=4, sequence_parallel=True)
    titan = dataclasses.replace(mega, model_implementation="torchtitan")
    sac = dataclasses.replace(titan, recompute_granularity="selective", recompute_modules=["layernorm"])
    assert layer_comm(MODEL, mega, HW, "dense").tp[2] > 0
    assert layer_comm(MODEL, titan, HW, "dense").tp[2] == 0
    assert not dataclasses.replace(titan, recompute_granularity="op").keeps_gathered_inputs  # op SAC's policy too
    assert layer_comm(MODEL, sac, HW, "dense").tp[2] == layer_comm(MODEL, dataclasses.replace(
        sac, model_implementation="megatron"), HW, "dense").tp[2]
    shard = ActivationModel(MODEL, mega).hidden_bytes
    a, b = ActivationModel(MODEL, mega).layer("dense"), ActivationModel(MODEL, titan).layer("dense")
    assert b.components["attention"] - a.components["attention"] == pytest.approx(3 * shard)
    assert b.components["mlp"] - a.components["mlp"] == pytest.approx(3 * shard)
    assert ActivationModel(MODEL, sac).layer("dense") == ActivationModel(
        MODEL, dataclasses.replace(sac, model_implementation="megatron")).layer("dense")


def test_torchtitan_rows_carry_its_code_and_only_the_eager_ones_its_eager_ops():
    """Every published row that ran torchtitan sets model_implementation torchtitan; elementwise_kernels
    torchtitan-eager exactly on those whose notes say the run was eager (compile false)."""
    runs = shipped_runs()
    titan = {r.id for r in runs if re.search("torchtitan", r.id + r.source + r.notes)}
    assert {r.id for r in runs if r.training.get("model_implementation") == "torchtitan"} == titan
    eager = {r.id for r in runs if r.training.get("elementwise_kernels") == "torchtitan-eager"}
    assert eager == {r.id for r in runs if r.id in titan and "Eager (compile false)" in r.notes}
    assert len(eager) == 5  # torchtitan 2412 eager 8B on 8 and 128 GPUs; the three CVS MI355X rows
