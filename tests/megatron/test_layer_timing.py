"""What the Megatron backend's layer timing counts as a chunk's layers and ends (calibration's split of a
node into per-layer cost and a fixed cost every chunk pays, docs/simulator.md "Fixed parts").

Work that grows with a chunk's layers must land in its ``layers`` spans, or calibration counts it as a
fixed cost each chunk of a vpp = 2 table pays again (a 1F1B stage's W loop over 24 weights charged to
each of two 3-layer chunks). And what only the first model stage holds (the embedding) must be timed as
``ends`` in the backward too, or its backward counts as every chunk's cost. A recorder whose clock
ticks once per reading makes the spans exact: the checks are on which readings each span joins, over
generated weight lists (weights of the decoder and of no timed part, in any order).
"""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


class TickingRecorder:
    """The recorder's protocol (``clock``, ``inside``) with a clock that ticks once per reading;
    ``watch`` (weak references) gives, per reading, how many of them were still alive."""

    def __init__(self, watch: tuple = ()) -> None:
        self.ticks = 0
        self.compute_nodes = 0
        self.spans: list[tuple[str, int, int, float]] = []
        self.watch = watch
        self.alive: list[int] = []

    def clock(self) -> int:
        self.ticks += 1
        self.alive.append(sum(ref() is not None for ref in self.watch))
        return self.ticks

    def inside(self, part: str, start: int, end: int, share: float = 1.0) -> None:
        self.spans.append((part, start, end, share))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=8))
def test_a_w_nodes_spans_cover_its_decoder_weights_work_without_gaps(weights):
    """``(in the decoder, rows, cols)`` per deferred weight, in B's order: every tick from the flush's
    start to the accumulation's end is the decoder's but the GEMMs of weights of no timed part (the
    output layer's), and what B kept for a weight (its input and output gradient) is freed within its
    own span (freeing a 6-layer stage's took 0.2 ms of CPU at hidden 128)."""
    import weakref

    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
    from primuspipe.backends.megatron.wgrad_store import WeightGradStore, _Deferred

    enable_cpu_mode()
    store = WeightGradStore()
    params, kept, expected_grads = [], [], []
    for _, rows, cols in weights:
        weight = torch.nn.Parameter(torch.zeros(rows, cols))
        params.append(weight)
        saved, grad_output = torch.rand(4, cols), torch.rand(4, rows)
        expected_grads.append(grad_output.t() @ saved)
        kept.append(weakref.ref(saved))
        store._work.setdefault((0, 0), []).append(_Deferred(weight, saved, grad_output, None, False, False, None))
    del saved, grad_output
    recorder = TickingRecorder(tuple(kept))
    store.timed = ({id(p): "layers" for p, (decoder, *_) in zip(params, weights) if decoder}, recorder)
    assert store.flush(0, 0) == len(weights)
    # one reading before the loop, one after each GEMM, one after the shares: reading i + 1 ends GEMM i
    untimed = {i + 1 for i, (decoder, *_) in enumerate(weights) if not decoder}
    covered: dict[int, float] = {}
    for part, start, end, share in recorder.spans:
        assert part == "layers" and start < end
        for tick in range(start, end):
            covered[tick] = covered.get(tick, 0.0) + share
    decoder_share = sum(r * c for (d, r, c) in weights if d) / sum(r * c for _, r, c in weights)
    last = recorder.ticks
    expected = {tick: 1.0 for tick in range(1, len(weights) + 1) if tick not in untimed}
    if decoder_share:
        expected[len(weights) + 1] = decoder_share  # the accumulation: the decoder's share of the elements
        assert last == len(weights) + 2
    assert covered.keys() == expected.keys() and all(covered[t] == pytest.approx(v) for t, v in expected.items())
    # reading i + 1 ends GEMM i: by then the weights up to i no longer hold what B kept
    assert recorder.alive[:len(weights) + 1] == [len(weights) - i for i in range(len(weights) + 1)]
    # the gradients are the GEMMs' (timing changes nothing)
    for p, grad in zip(params, expected_grads):
        assert torch.equal(p.grad, grad)


class _Chunk(torch.nn.Module):
    """A chunk of the shape the timing looks for: an ``embedding`` (the first stage's own module) and a
    ``decoder`` (its layer stack)."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.decoder = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.embedding(tokens)).sum()


@settings(max_examples=10, deadline=None)
@given(st.integers(4, 32), st.integers(2, 8), st.integers(1, 4), st.integers(1, 6))
def test_the_embeddings_backward_is_timed_as_ends(vocab, hidden, layers, tokens):
    """Forward and backward of a chunk holding the embedding: ``ends`` gets the embedding's forward and
    its backward, from the gradient of its output (when the decoder's backward ends) to its weight's
    accumulated gradient; ``layers`` the decoder's forward and backward."""
    from primuspipe.backends.megatron.layer_timing import timing_layers

    class Store:
        timed = None

    chunk, recorder = _Chunk(vocab, hidden, layers), TickingRecorder()
    with timing_layers([chunk], recorder, Store()):
        loss = chunk(torch.randint(0, vocab, (tokens,)))
        forward = list(recorder.spans)
        loss.backward()
    backward = recorder.spans[len(forward):]
    assert [part for part, *_ in forward] == ["ends", "layers"]
    assert [part for part, *_ in backward] == ["layers", "ends"], backward
    (_, decoder_start, decoder_end, _), (_, start, end, _) = backward
    # the embedding's backward starts as the decoder's ends (both hooked on the same tensor's gradient)
    # and ends once its weight's gradient is in
    assert decoder_start < start < end and decoder_end < end and start - decoder_end <= 1
    assert chunk.embedding.weight.grad is not None
    # outside a recorded step nothing is hooked
    recorder.spans.clear()
    chunk(torch.randint(0, vocab, (tokens,))).backward()
    assert recorder.spans == []


@settings(max_examples=10, deadline=None)
@given(st.integers(4, 32), st.integers(2, 8), st.integers(1, 4), st.integers(1, 6), st.integers(1, 3))
def test_a_gradient_landing_in_a_later_node_opens_no_span_from_an_earlier_one(vocab, hidden, layers, tokens, later):
    """The embedding's weight also gets a gradient in a later node (at pp = 1 the output layer's weight is the
    tied word embedding, and a W accumulates it): that node's accumulation must not close the span the
    embedding's backward opened nodes before (it gave a W an ``ends`` longer than the W itself on the GPU)."""
    from primuspipe.backends.megatron.layer_timing import timing_layers

    class Store:
        timed = None

    chunk, recorder = _Chunk(vocab, hidden, layers), TickingRecorder()
    with timing_layers([chunk], recorder, Store()):
        chunk(torch.randint(0, vocab, (tokens,))).backward()
        spans = len(recorder.spans)
        recorder.compute_nodes += later  # the B is recorded; a later node accumulates the tied weight's gradient
        weight = chunk.embedding.weight
        torch.autograd.backward([weight], [torch.ones_like(weight)])
    assert len(recorder.spans) == spans, recorder.spans[spans:]
