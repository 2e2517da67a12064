"""The time model's loss and dropout work, held against what the real operations touch.

* The unfused vocab-parallel cross entropy: megatron-core's own ``vocab_parallel_cross_entropy`` run forward and
  backward on CPU (its all-reduces on torch's ``fake`` backend), every aten operation over logit-sized tensors
  counted as a GPU kernel moves it, against the bytes :meth:`WorkModel.head` prices beside the output GEMM.
* The fused one (``native``): megatron-core's own ``fused_vocab_parallel_cross_entropy``, its four ``@jit_fuser``
  regions run eager and each counted as the one kernel ``torch.compile`` makes of it at best (every logit-sized
  input read once, every logit-sized output or mutated input written once); Transformer Engine's (``te``) against
  its three Triton kernels' loads and stores.
* Dropout: PyTorch's own ``native_dropout`` / ``native_dropout_backward`` (the kernels ``F.dropout`` runs on a
  GPU) give the per-element bytes; the layers, embedding and attention of generated models and layouts price
  exactly those at each dropout site, and nothing at dropout 0.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from projection_megatron import fake_parallel_state
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from primuspipe.projection.activations import MASK_BYTES as DROPOUT_MASK_BYTES
from primuspipe.projection.compute import WorkModel, part_times, Calibration
from primuspipe.projection.framework import PrimusPipeError
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "projection"
NOT_PASSES = {"index", "index_put_", "mm", "_unsafe_view"}
"""Advanced indexing of each token's target logit (a gather / scatter of one element a row), the output layer's
GEMMs (priced as GEMMs) and ``matmul``'s reshape of its output (no data moved): no pass over the logits."""


class _LogitTraffic(TorchDispatchMode):
    """Bytes the aten operations move over tensors of ``numel`` elements (the logits): each distinct storage a
    non-view operation reads (its positional tensor arguments; an ``out=`` buffer is written, not read) and
    every logit-sized output it writes, by phase."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.phase, self.moved = numel, "forward", {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name in NOT_PASSES:
            return out
        big = lambda ts: [t for t in ts if isinstance(t, torch.Tensor) and t.numel() == self.numel]  # noqa: E731
        reads = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in big(tree_leaves(args))}
        writes = sum(t.numel() * t.element_size() for t in big(tree_leaves(out)))
        self.moved[self.phase] += sum(reads.values()) + writes
        return out


def _loss_cases() -> list[tuple[int, int, int, str]]:
    rng = random.Random(26)
    return [(rng.choice([1, 2]), rng.choice([64, 96, 256]), 128 * rng.randint(1, 24), rng.choice(["bf16", "fp32"]))
            for _ in range(8)]


def _loss_inputs(tokens: tuple[int, ...], hidden_size: int, vocab: int, precision: str, seed: int):
    """``(hidden, weight, target)`` for a loss over ``tokens`` (the shape the loss takes them in), in the run's
    precision."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*tokens, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(vocab, tokens, generator=generator)


@pytest.mark.parametrize("mbs, seq, vocab, precision", _loss_cases())
def test_unfused_cross_entropy_moves_what_megatron_core_dispatches(mbs, seq, vocab, precision):
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=2, seq_length=seq, vocab_size=vocab,
                      untie_embeddings_and_output_weights=True)
    training = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=mbs, global_batch_size=mbs,
                            precision=precision)
    hidden, weight, target = _loss_inputs((seq, mbs), model.hidden_size, vocab, precision, seed=seq + vocab)
    traffic = _LogitTraffic(seq * mbs * vocab)
    with fake_parallel_state(training):  # CPU mode first: megatron-core imports triton unguarded
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        with traffic:  # the logits come out of the output layer's GEMM, as in the model (not a leaf)
            loss = vocab_parallel_cross_entropy(hidden @ weight.t(), target)
            traffic.phase = "backward"
            loss.backward(torch.ones_like(loss))
    work = WorkModel(model, training)
    head = work.head()
    norm = 2 * work.hidden_bytes  # the final norm's forward read and write (backward: 1.5 times it)
    assert head.forward.memory_bytes - norm == traffic.moved["forward"]
    assert head.backward_input.memory_bytes - 1.5 * norm == traffic.moved["backward"]


class _RegionTraffic(_LogitTraffic):
    """:class:`_LogitTraffic` that counts each wrapped region (:meth:`region`) as one kernel: its logit-sized
    inputs read once, its logit-sized outputs that are not inputs and the inputs it mutates (their version
    counter moved) written once; operations outside regions count one by one."""

    inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def region(self, compiled):
        eager = compiled._torchdynamo_orig_callable

        def run(*args):
            big = {a.untyped_storage().data_ptr(): a for a in args
                   if isinstance(a, torch.Tensor) and a.numel() == self.numel}
            versions = {ptr: a._version for ptr, a in big.items()}
            self.inside += 1
            try:
                out = eager(*args)
            finally:
                self.inside -= 1
            written = {t.untyped_storage().data_ptr(): t for t in tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.numel() == self.numel}
            written = {ptr: t for ptr, t in written.items() if ptr not in big}
            written |= {ptr: a for ptr, a in big.items() if a._version != versions[ptr]}
            self.moved[self.phase] += sum(t.numel() * t.element_size() for t in [*big.values(), *written.values()])
            return out

        return run


REGIONS = ("calculate_logits_max", "calculate_predicted_logits", "calculate_cross_entropy_loss", "calculate_gradients")
"""megatron-core's ``@jit_fuser`` functions of the fused loss (``fusions/fused_cross_entropy.py``)."""


@pytest.mark.parametrize("mbs, seq, vocab, precision", _loss_cases())
def test_native_fused_cross_entropy_moves_what_its_compiled_regions_must(mbs, seq, vocab, precision, monkeypatch):
    """The ``native`` fused loss is no single kernel: its regions still make, rescale and keep the fp32 softmax
    (issue 26: it was priced at ``2e`` each way, as one kernel reading the logits and writing the gradient)."""
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=2, seq_length=seq, vocab_size=vocab,
                      untie_embeddings_and_output_weights=True)
    training = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=mbs, global_batch_size=mbs,
                            precision=precision, cross_entropy_loss_fusion=True)
    hidden, weight, target = _loss_inputs((seq, mbs), model.hidden_size, vocab, precision, seed=seq + vocab)
    traffic = _RegionTraffic(seq * mbs * vocab)
    with fake_parallel_state(training) as state:
        import megatron.core.fusions.fused_cross_entropy as fused

        for name in REGIONS:
            monkeypatch.setattr(fused, name, traffic.region(getattr(fused, name)))
        with traffic:
            loss = fused.fused_vocab_parallel_cross_entropy(hidden @ weight.t(), target,
                                                            state.get_tensor_model_parallel_group())
            traffic.phase = "backward"
            loss.backward(torch.ones_like(loss))
    work = WorkModel(model, training)
    head = work.head()
    norm = 2 * work.hidden_bytes
    assert head.forward.memory_bytes - norm == traffic.moved["forward"]
    assert head.backward_input.memory_bytes - 1.5 * norm == traffic.moved["backward"]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_te_fused_cross_entropy_reads_twice_and_writes_the_gradient_in_place(precision):
    """Transformer Engine's ``parallel_cross_entropy`` (``pytorch/triton/cross_entropy.py``, 2.7 to 2.12):
    ``online_softmax_kernel`` reads each logit, ``cross_entropy_kernel`` reads it and stores its gradient in place,
    backward ``element_mul_kernel`` loads and stores it once more -- in the logits' dtype, below the ``native``
    loss's fp32 traffic."""
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=2, seq_length=128, vocab_size=1024,
                      untie_embeddings_and_output_weights=True)
    priced = {}
    for impl in ("te", "native"):
        training = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=1, global_batch_size=1,
                                precision=precision, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=impl)
        work = WorkModel(model, training)
        logits = 128 * 1024
        norm = 2 * work.hidden_bytes
        priced[impl] = ((work.head().forward.memory_bytes - norm) / logits,
                        (work.head().backward_input.memory_bytes - 1.5 * norm) / logits)
    e = 2 if precision == "bf16" else 4
    assert priced["te"] == (3 * e, 2 * e)
    assert priced["te"][0] < priced["native"][0] and priced["te"][1] < priced["native"][1]


class _TorchLossTraffic(_LogitTraffic):
    """:class:`_LogitTraffic` for PyTorch's ``F.cross_entropy``: ``nll_loss_forward`` picks one element a row (no
    pass), and ``nll_loss_backward`` takes the log-softmax output for its shape only, writing a zero-filled
    gradient of that size (its write counted, not a read)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name == "nll_loss_forward":
            return func(*args, **(kwargs or {}))
        if name == "nll_loss_backward":
            out = func(*args, **(kwargs or {}))
            self.moved[self.phase] += out.numel() * out.element_size()
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("upcast", ["fp32", "native"])
@pytest.mark.parametrize("mbs, seq, vocab, precision", _loss_cases()[:4])
def test_torch_cross_entropy_moves_what_automodel_masked_ce_dispatches(mbs, seq, vocab, precision, upcast):
    """NeMo AutoModel's ``MaskedCrossEntropy`` (``fp32_upcast`` true or false): reshape, optional ``.float()``,
    ``F.cross_entropy`` summed -- the forward and backward bytes the head prices for ``torch_cross_entropy``."""
    model = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=2, seq_length=seq, vocab_size=vocab,
                      untie_embeddings_and_output_weights=True)
    training = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=mbs, global_batch_size=mbs,
                            precision=precision, torch_cross_entropy=upcast)
    hidden, weight, target = _loss_inputs((mbs * seq,), model.hidden_size, vocab, precision, seed=seq + vocab)
    traffic = _TorchLossTraffic(seq * mbs * vocab)
    with traffic:
        logits = (hidden @ weight.t()).view(-1, vocab)
        logits = logits.float() if upcast == "fp32" else logits
        loss = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        traffic.phase = "backward"
        loss.backward()
    work = WorkModel(model, training)
    head = work.head()
    norm = 2 * work.hidden_bytes
    assert head.forward.memory_bytes - norm == traffic.moved["forward"]
    assert head.backward_input.memory_bytes - 1.5 * norm == traffic.moved["backward"]


def test_torch_cross_entropy_is_a_loss_of_its_own():
    with pytest.raises(PrimusPipeError, match="loss of its own"):
        TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=1, global_batch_size=1,
                     torch_cross_entropy="native", cross_entropy_loss_fusion=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_dropout_moves_two_elements_and_a_mask_each_way(dtype):
    """The kernels ``F.dropout`` runs on a GPU: forward reads x and writes the output and a bool mask; backward reads
    the gradient and the mask and writes the gradient. The per-element bytes the model prices."""
    x = torch.randn(1000).to(dtype)
    out, mask = torch.ops.aten.native_dropout(x, 0.1, True)
    grad = torch.ops.aten.native_dropout_backward(out, mask, 1 / 0.9)
    assert mask.element_size() == DROPOUT_MASK_BYTES
    e = x.element_size()
    forward = (x.numel() * e + out.numel() * e + mask.numel() * mask.element_size()) / x.numel()
    backward = (out.numel() * e + mask.numel() * mask.element_size() + grad.numel() * e) / x.numel()
    assert forward == backward == 2 * e + DROPOUT_MASK_BYTES


def _dropout_cases() -> list[tuple[ModelSpec, TrainingSpec]]:
    rng = random.Random(8)
    cases = []
    for _ in range(10):
        heads = rng.choice([8, 16, 32])
        model = ModelSpec(num_layers=4, hidden_size=heads * rng.choice([64, 128]), num_attention_heads=heads,
                          seq_length=rng.choice([1024, 2048, 4096]), vocab_size=32000,
                          swiglu=rng.random() < 0.5, add_bias_linear=rng.random() < 0.5)
        tp = rng.choice([1, 2, 4, 8])
        training = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=rng.choice([1, 2, 4]),
                                global_batch_size=64, tensor_model_parallel_size=tp,
                                sequence_parallel=tp > 1 and rng.random() < 0.7,
                                precision=rng.choice(["bf16", "fp32"]),
                                attention_backend=rng.choice(["flash", "fused", "unfused"]))
        cases.append((model, training))
    return cases


@pytest.mark.parametrize("model, training", _dropout_cases())
def test_hidden_dropout_prices_its_mask_and_masking_pass_at_each_site(model, training):
    dropped = dataclasses.replace(model, hidden_dropout=0.1)
    plain, work = WorkModel(model, training), WorkModel(dropped, training)
    elements, e = work.residual_tokens * model.hidden_size, work.e
    layer, base = work.layer("dense"), plain.layer("dense")
    # two bias-dropout-add sites a layer: the fused kernel writes the mask; a masking pass backward
    assert layer.forward.memory_bytes - base.forward.memory_bytes == pytest.approx(2 * elements * DROPOUT_MASK_BYTES)
    assert layer.backward_input.memory_bytes - base.backward_input.memory_bytes == pytest.approx(
        2 * elements * (2 * e + DROPOUT_MASK_BYTES))
    assert layer.backward_weight == base.backward_weight
    # the embedding's dropout is a native_dropout of its own each way
    for new, old in zip(work.embedding().passes()[:2], plain.embedding().passes()[:2]):
        assert new.memory_bytes - old.memory_bytes == pytest.approx(elements * (2 * e + DROPOUT_MASK_BYTES))
    assert WorkModel(dataclasses.replace(model, hidden_dropout=0.0), training).layer("dense") == base


@pytest.mark.parametrize("model, training", _dropout_cases())
def test_attention_dropout_prices_the_probabilities_or_the_fused_kernels_rate(model, training):
    hardware = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    dropped = dataclasses.replace(model, attention_dropout=0.1)
    plain, work = WorkModel(model, training), WorkModel(dropped, training)
    layer, base = work.layer("dense"), plain.layer("dense")
    e = work.e
    scores = training.micro_batch_size * model.num_attention_heads / training.tp * model.seq_length ** 2
    if training.flash_attention:  # inside the kernel: no bytes, the kernels at attention_dropout_rate
        assert layer.forward.memory_bytes == base.forward.memory_bytes
        times, before = (part_times(w, hardware, Calibration())["dense"] for w in (work, plain))
        for now, was in zip(times.attention, before.attention):
            assert now == pytest.approx(was / hardware.attention_dropout_rate)
        free = dataclasses.replace(hardware, attention_dropout_rate=1.0)
        assert part_times(work, free, Calibration())["dense"].attention == before.attention
    else:  # native_dropout over the probabilities, each way
        extra = scores * (2 * e + DROPOUT_MASK_BYTES)
        assert layer.forward.memory_bytes - base.forward.memory_bytes == pytest.approx(extra)
        assert layer.backward_input.memory_bytes - base.backward_input.memory_bytes == pytest.approx(extra)
    assert layer.forward.attention_flops == base.forward.attention_flops  # dropout adds no FLOPs


def test_attention_dropout_rate_is_a_fraction():
    from primuspipe.projection.spec_fields import InputError

    hardware = load_hardware(EXAMPLES / "hardware" / "h100.yaml")
    for bad in (0.0, 1.2, -0.5):
        with pytest.raises(InputError, match="attention_dropout_rate"):
            dataclasses.replace(hardware, attention_dropout_rate=bad)


@pytest.mark.parametrize("model, training", _dropout_cases())
def test_the_embedding_makes_its_whole_weight_gradient_every_microbatch(model, training):
    """``F.embedding``'s backward returns a gradient of the whole table (zeros but the looked-up rows), which
    megatron-core's DDP hook then adds into the main gradient: both priced in B, per microbatch."""
    work = WorkModel(model, training)
    vocab = model.padded_vocab(training.tp) // training.tp
    table = torch.zeros(vocab, 8, requires_grad=True)
    tokens = torch.randint(vocab, (5,))
    torch.nn.functional.embedding(tokens, table).sum().backward()
    assert table.grad.shape == table.shape  # dense: every row written, not only the five looked up
    params = vocab * model.hidden_size + model.seq_length * model.hidden_size  # and the learned positions' table
    zeros_and_add = params * (work.e + work.e + 2 * training.main_grad_bytes)
    assert work.embedding().backward_input.memory_bytes == pytest.approx(2 * work.hidden_bytes + zeros_and_add)
    assert work.embedding().backward_weight.memory_bytes == 0


def test_a_prediction_module_sums_its_embedding_gradient_into_the_models():
    """Multi-token prediction looks the tokens up in the model's own tables: its backward makes a second zeroed
    table that autograd adds to the first, and the parameter is accumulated into its main gradient once."""
    model = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=512, vocab_size=4096,
                      position_embedding_type="rope")
    training = TrainingSpec(pipeline_model_parallel_size=1, micro_batch_size=1, global_batch_size=8, mtp_num_layers=1)
    work = WorkModel(model, training)
    own, second = work.embedding(), work.embedding(shared=True)
    params = model.padded_vocab(1) * model.hidden_size
    assert own.backward_input.memory_bytes - second.backward_input.memory_bytes == pytest.approx(
        params * (2 * work.e + 2 * training.main_grad_bytes - 4 * work.e))
    table = torch.zeros(16, 4, requires_grad=True)
    seen = []
    table.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    tokens = torch.tensor([1, 3])
    (torch.nn.functional.embedding(tokens, table).sum() + torch.nn.functional.embedding(tokens, table).sum()).backward()
    assert len(seen) == 1  # one accumulation (megatron-core's DDP hook runs there) for both lookups
