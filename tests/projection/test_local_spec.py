"""The projection's work and memory for megatron-core's local spec (``--transformer-impl local``), held against
what a real local-spec layer dispatches on CPU (``tests/support/dispatched_work.py``): the bytes of its element-wise
aten operations, the FLOPs of its GEMMs, the bytes autograd keeps and the transient peak of forward and backward."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from dispatched_work import cuda_softmax_product, record_layer, record_model

from primuspipe.projection.activations import ActivationModel
from primuspipe.projection.compute import WorkModel
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.projection import Projector
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
# The lent H100's single-GPU run (h 2048, 16 heads of 128, s 2048, FFN 4h, LayerNorm, GELU with biases) scaled
# down with the same head width and a*s/h = 16, so score-sized and hidden-sized work stand in the same ratio.
GPT2_LIKE = ModelSpec(num_layers=1, hidden_size=256, num_attention_heads=2, ffn_hidden_size=1024, seq_length=2048,
                      vocab_size=64, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                      position_embedding_type="learned_absolute")
LOCAL = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=1, global_batch_size=1, attention_backend="local",
                     bias_activation_fusion=False, gradient_accumulation_fusion=False)
CASES = {
    "gpt2-like": (GPT2_LIKE, LOCAL),
    "two-samples-short": (dataclasses.replace(GPT2_LIKE, seq_length=512, num_attention_heads=4),
                          dataclasses.replace(LOCAL, micro_batch_size=2, global_batch_size=2)),
    "bf16-softmax": (GPT2_LIKE, dataclasses.replace(LOCAL, attention_softmax_in_fp32=False)),
    "grouped-queries": (dataclasses.replace(GPT2_LIKE, seq_length=1024, num_attention_heads=4, num_query_groups=2,
                                            kv_channels=64), LOCAL),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    model, training = CASES[request.param]
    return model, training, record_layer(model, training)


def test_local_layer_moves_the_bytes_and_flops_megatron_core_dispatches(case):
    model, training, record = case
    work = WorkModel(model, training).layer("dense")
    scores, grad_bytes = cuda_softmax_product(model, training)
    assert work.forward.memory_bytes == pytest.approx(record.moved("forward"), rel=0.005)
    assert work.backward_input.memory_bytes == pytest.approx(record.moved("backward") + 3 * scores * grad_bytes,
                                                             rel=0.005)  # the product read two, wrote one
    assert work.forward.gemm_flops == record.flops("forward")  # the projections and the two batched GEMMs
    assert work.backward_input.gemm_flops + work.backward_weight.gemm_flops == record.flops("backward")
    assert work.forward.attention_flops == work.backward_input.attention_flops == 0


def test_local_layer_keeps_and_briefly_holds_what_the_activation_model_counts(case):
    model, training, record = case
    activations = ActivationModel(model, training)
    # the record holds the layer's output and the global score buffer, not its input (made before it): the
    # output stands in for the input the activation model counts. CPU keeps a bf16 norm's mean and 1/std in bf16
    # where CUDA keeps fp32, two bytes a token each for each of the two norms.
    per_norm = 2 * 2 * training.micro_batch_size * model.seq_length if training.precision == "bf16" else 0
    kept = activations.layer("dense").total + activations.attention_buffer() - 2 * per_norm
    assert kept == record.saved_bytes
    h, f = model.hidden_size, model.ffn
    # the weight gradients made before the peak (output projection, MLP, pre-MLP norm): megatron-core's DDP hook
    # moves each into its main gradient and drops it
    weight_grads = 2 * (h * h + 2 * h * f + h + f + h + 2 * h)
    transient = record.peak_bytes - record.saved_bytes - weight_grads - per_norm  # the pre-MLP norm's, freed
    # on a GPU the product is alive beside the softmax's gradient and result: with the softmax in fp32 the
    # backward's peak rises by it; in bf16 that moment (three bf16 tensors) ties the CopySlices one the CPU peaks at
    scores, grad_bytes = cuda_softmax_product(model, training)
    transient += scores * grad_bytes if training.attention_softmax_in_fp32 else 0
    assert transient <= activations.attention_working_set() <= 1.02 * transient  # never under


def test_other_backends_gain_no_local_spec_terms():
    for backend in ("flash", "fused", "unfused"):
        training = dataclasses.replace(LOCAL, attention_backend=backend)
        activations = ActivationModel(GPT2_LIKE, training)
        assert activations.attention_working_set() == activations.attention_buffer() == 0.0
        work = WorkModel(GPT2_LIKE, training)
        assert work._local_spec_elements("dense").forward.memory_bytes == 0.0


def test_a_whole_local_spec_model_peaks_where_the_projection_says():
    """Embedding, four layers, head and loss of one microbatch: the projection's activations and working set (1F1B
    on one GPU holds one microbatch) against the peak of live bytes of the real model's forward and backward. The
    record's peak also holds the weight gradients made by then (at most all of them, before megatron-core's DDP
    hook would move each into its main gradient)."""
    model, training = dataclasses.replace(GPT2_LIKE, num_layers=4), LOCAL
    record = record_model(model, training)
    result = Projector(model, load_hardware(EXAMPLES / "hardware" / "h100.yaml")).evaluate(training, "1f1b")
    projected = result.memory_breakdown["activations"] + result.memory_breakdown["recompute_working_set"]
    weight_grads = 2 * result.memory_breakdown["weights"] / 2  # bf16 weights, bf16 gradients
    cpu_norm_stats = 9 * 2 * 2 * model.seq_length  # 9 norms keep bf16 statistics on CPU, fp32 on CUDA
    scores, grad_bytes = cuda_softmax_product(model, training)
    cpu = projected - cpu_norm_stats - scores * grad_bytes  # and the GPU's softmax backward product
    assert record.peak_bytes - weight_grads <= cpu <= 1.01 * record.peak_bytes
