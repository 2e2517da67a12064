"""Zero-bubble tables (B, W and overlapped FB nodes) in real megatron-core training (CPU, gloo).

Losses and every parameter gradient (and forward_only's losses) equal Megatron's native 1F1B at the same pp (vpp=1 tables) or a
pp=1 run (V-shape tables, whose chunks Megatron's own schedules cannot run); all comparisons are
bitwise (the deferred weight GEMM is the same arithmetic, accumulated in the same microbatch order).
A DDP + finalize_model_grads + SGD step matches too. The W node really is only the weight GEMMs
(GEMM counts per node), and a W without its B, a B without its W, or a B run twice is a clear error.
One gloo launch per layout runs all of that layout's cases.
"""

import dataclasses
import functools
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from megatron_harness import assert_same_tensors, merged, pp1_references, stacked_losses  # noqa: E402

from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.backends.megatron.binder import MegatronBinder  # noqa: E402
from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.errors import ConfigError  # noqa: E402

GPT = tiny_models.TINY_MODELS["tiny-gpt"]
MOE = tiny_models.TINY_MODELS["tiny-moe"]
V_ALGORITHMS = ("zbv", "v-half", "v-min", "dualpipe-v")


@dataclasses.dataclass(frozen=True)
class Case:
    algorithm: str
    m: int
    model: tiny_models.TinyModelConfig = GPT
    train: bool = False
    """DDP + finalize_model_grads + SGD step."""
    options: tuple = ()

    @property
    def placement(self):
        return "v" if self.algorithm in V_ALGORITHMS else "interleaved"

    @property
    def id(self):
        extra = ("-train" if self.train else "") + ("-moe" if self.model is MOE else "")
        extra += "".join(f"-{k}={v}" for k, v in self.options)
        return f"{self.algorithm}-m{self.m}{extra}"

    def spec(self, forward_only=False):
        return compare.StepSpec(self.model, self.m, ddp=self.train, optimizer_step=self.train and not forward_only,
                                forward_only=forward_only, placement=self.placement)

    def schedule(self):
        return PrimusForwardBackward(PrimusPipeConfig(True, self.algorithm, algorithm_options=dict(self.options)))


LOWERED = (("overlap", False),)
CASES = {
    ParallelLayout(2): [Case("zb-h1", 1), Case("zb-h1", 3), Case("zb-h1", 4, train=True), Case("zb-h2", 2),
                        Case("zb-h2", 5), Case("zb-h1", 3, model=MOE)],
    ParallelLayout(4): [Case("zb-h1", 2), Case("zb-h1", 5), Case("zb-h2", 3), Case("zb-h2", 6, train=True)],
    ParallelLayout(2, vpp=2): [Case("zbv", 1), Case("zbv", 3), Case("zbv", 4, train=True), Case("v-half", 2),
                               Case("v-min", 3), Case("dualpipe-v", 4), Case("dualpipe-v", 5, options=LOWERED),
                               Case("zbv", 3, model=MOE)],
    ParallelLayout(4, vpp=2): [Case("zbv", 2), Case("zbv", 5), Case("v-half", 3), Case("v-min", 4),
                               Case("dualpipe-v", 8, train=True), Case("dualpipe-v", 8, options=LOWERED)],
}


class _GemmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts matrix multiplications (aten mm/addmm/bmm) run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=None)
def _counting_handlers():
    """MegatronBinder's backward handlers, wrapped to log ``(kind, chunk, mb) -> GEMMs``."""
    log = {}

    def wrap(kind, method):
        def handler(self, call):
            with _GemmCounter() as counter:
                result = method(self, call)
            log[(kind, call.chunk, call.microbatch)] = counter.count
            return result
        return handler

    return log, {"backward": wrap("BW", MegatronBinder.backward),
                 "backward_input": wrap("B", MegatronBinder.backward_input),
                 "backward_weight": wrap("W", MegatronBinder.backward_weight)}


def _gemm_counts(layout):
    """GEMMs per backward node of 1f1b (BW) and zb-h1 (B, W) on the same model and data."""
    log, wrapped = _counting_handlers()
    originals = {name: getattr(MegatronBinder, name) for name in wrapped}
    counts = {}
    try:
        for name, fn in wrapped.items():
            setattr(MegatronBinder, name, fn)
        for algorithm in ("1f1b", "zb-h1"):
            log.clear()
            compare.run_step(PrimusForwardBackward(PrimusPipeConfig(True, algorithm)), compare.StepSpec(GPT, 2),
                             layout.pp, layout.vpp)
            counts[algorithm] = dict(log)
    finally:
        for name, fn in originals.items():
            setattr(MegatronBinder, name, fn)
    return counts


def _refusals(layout):
    """The message of the ConfigError a V table on interleaved-built chunks gives."""
    out = {}
    try:
        compare.run_step(Case("zbv", 2).schedule(), compare.StepSpec(GPT, 2, placement="interleaved"), layout.pp,
                         layout.vpp)
    except ConfigError as exc:
        out["placement"] = str(exc)
    return out


def _worker(layout, ctx):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = {}
    for case in CASES[layout]:
        row = {"ours": compare.run_step(case.schedule(), case.spec(), layout.pp, layout.vpp),
               "ours_fwd": compare.run_step(case.schedule(), case.spec(forward_only=True), layout.pp, layout.vpp)}
        if layout.vpp == 1:
            row["native"] = compare.run_step(get_forward_backward_func(), case.spec(), layout.pp, layout.vpp)
        out[case.id] = row
    if layout == ParallelLayout(2):
        out["gemms"] = _gemm_counts(layout)
    if layout == ParallelLayout(2, vpp=2):
        out["refusals"] = _refusals(layout)
        out["tied"] = _tied_v_embeddings(ctx)
    return out


def _tied_v_embeddings(ctx):
    """The V builder's pieces (v_stage_flags + v_layer_offsets around GPTModel) with tied embeddings: what
    Megatron's own initialisation leaves in the output layer's copy, and the two refusals."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from primuspipe.backends.megatron.compat import check_megatron_config
    from primuspipe.backends.megatron.v_placement import v_layer_offsets, v_stage_flags

    model = dataclasses.replace(GPT, tie_embeddings=True)
    config = tiny_models.transformer_config(model, 2, 2)
    chunks = []
    for vp_stage in (0, 1):
        pre, post = v_stage_flags(2, ctx.pp_rank, vp_stage)
        with v_layer_offsets(2):
            chunks.append(GPTModel(config, get_gpt_layer_local_spec(), model.vocab_size, model.seq_length,
                                   pre_process=pre, post_process=post, share_embeddings_and_output_weights=True,
                                   position_embedding_type="learned_absolute", vp_stage=vp_stage))
    out = {}
    if ctx.pp_rank == 0:
        embedding, output = chunks[0].embedding.word_embeddings.weight, chunks[1].output_layer.weight
        out["initialised"] = torch.equal(embedding, output) and bool(output.any())
        table = Case("zbv", 2).schedule().table_for(2, 2, 2)
        with torch.no_grad():
            output.add_(1.0)
        try:
            check_megatron_config(config, table, chunks, 0)
        except ConfigError as exc:
            out["drifted"] = str(exc)
    spec = compare.StepSpec(model, 2, ddp=True, placement="v")
    _, _, wrapped = compare.build(spec, 2, 2)
    config = wrapped[0].config
    config.finalize_model_grads_func = lambda *args, **kwargs: None  # not Megatron's: never sums the copies
    try:
        compare.call_schedule(Case("zbv", 2).schedule(), spec, wrapped)
    except ConfigError as exc:
        out["finalize"] = str(exc)
    return out


@functools.lru_cache(maxsize=None)
def _run(layout):
    return run_on_gloo(functools.partial(_worker, layout), layout, timeout_s=300)


PP1_KEYS = frozenset((c.model, c.m, c.train) for layout, cases in CASES.items() if layout.vpp > 1 for c in cases)


PARAMS = [pytest.param(layout, case, id=f"pp{layout.pp}-vpp{layout.vpp}-{case.id}")
          for layout, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("layout,case", PARAMS)
def test_split_backward_table_matches_megatron(layout, case):
    results = _run(layout)
    holder = results[-1]  # Megatron's contract: loss dicts on the last pipeline rank, also for the V
    assert [bool(r[case.id]["ours"].losses) for r in results] == [False] * (layout.pp - 1) + [True]
    if layout.vpp == 1:
        want_losses = stacked_losses(results[-1][case.id]["native"])
        want_grads, want_params = (merged(results, case.id, "native", a) for a in ("grads", "params"))
    else:
        ref = pp1_references(PP1_KEYS)[(case.model, case.m, case.train)]
        want_losses, want_grads, want_params = stacked_losses(ref), ref.grads, ref.params
    got_losses = stacked_losses(holder[case.id]["ours"])
    assert len(got_losses) == case.m
    assert torch.equal(got_losses, want_losses)
    assert_same_tensors(merged(results, case.id, "ours", "grads"), want_grads, "grad", bitwise=True)
    if case.train:
        assert_same_tensors(merged(results, case.id, "ours", "params"), want_params, "param after optimizer step",
                            bitwise=True)
    assert torch.equal(stacked_losses(holder[case.id]["ours_fwd"]), got_losses), "forward_only gives the training losses"


def test_w_runs_only_the_weight_gemms():
    """B + W run exactly the GEMMs of one fused backward, and W at least one per deferred linear: the
    weight gradient is deferred, not recomputed from a second backward."""
    for rank, result in enumerate(_run(ParallelLayout(2))):
        fused, split = result["gemms"]["1f1b"], result["gemms"]["zb-h1"]
        assert set(fused) == {("BW", 0, mb) for mb in range(2)}
        for mb in range(2):
            b, w, bw = split[("B", 0, mb)], split[("W", 0, mb)], fused[("BW", 0, mb)]
            assert b + w == bw, f"rank {rank} mb {mb}: B {b} + W {w} GEMMs != fused backward {bw}"
            assert w >= 4 * tiny_models.TINY_MODELS["tiny-gpt"].num_layers // 2, f"rank {rank}: W has only {w} GEMMs"


def test_tied_embeddings_in_the_v():
    """On rank 0 the output layer's copy starts as the word embedding (Megatron's all-reduce would give it,
    but the embedding group is the wrong set of ranks in the V); copies that drifted and a finalize
    function that skips Megatron's embedding step are refused. Training with tied embeddings matches
    Megatron bitwise in test_feature_matrix.py."""
    rank0, rank1 = (r["tied"] for r in _run(ParallelLayout(2, vpp=2)))
    assert rank0["initialised"]
    assert "differs from the word embedding" in rank0["drifted"] and "v_model_provider" in rank0["drifted"]
    assert "did not call it" in rank0["finalize"] and "finalize" not in rank1


def test_v_table_on_interleaved_chunks_is_refused():
    message = _run(ParallelLayout(2, vpp=2))[0]["refusals"]["placement"]
    assert "v_placement" in message and "pre_process" in message


def _linear_setup():
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as linear

    gen = torch.Generator().manual_seed(3)
    w1 = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    b1 = torch.nn.Parameter(torch.randn(8, generator=gen))
    w2 = torch.nn.Parameter(torch.randn(3, 8, generator=gen))
    inputs = [torch.randn(5, 2, 4, generator=gen, requires_grad=True) for _ in range(3)]

    def loss(x):
        hidden = torch.tanh(linear(x, w1, b1, False, False, False))
        return linear(hidden, w2, None, False, False, False).pow(2).sum()

    return (w1, b1, w2), inputs, loss


def test_store_defers_exactly_the_weight_gradients():
    from primuspipe.backends.megatron.wgrad_store import WeightGradStore

    params, inputs, loss = _linear_setup()
    for x in inputs:
        loss(x).backward()
    want = [p.grad.clone() for p in params] + [x.grad.clone() for x in inputs]
    for t in (*params, *inputs):
        t.grad = None
    store = WeightGradStore()
    losses = [loss(x) for x in inputs]
    for mb, value in enumerate(losses):
        with store.collecting(0, mb):
            value.backward()
        assert params[0].grad is None and params[2].grad is None, "B leaves weight gradients to W"
        assert params[1].grad is not None, "bias gradients are computed in B"
    assert store.pending() == ((0, 0), (0, 1), (0, 2))
    for mb in range(3):  # in microbatch order, as the fused backward accumulated them: bitwise
        assert store.flush(0, mb) == 2
    store.check_empty()
    got = [p.grad for p in params] + [x.grad for x in inputs]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_store_errors_and_scope():
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Linear

    from primuspipe.backends.megatron.wgrad_store import WeightGradStore
    from primuspipe.errors import WeightGradError

    params, inputs, loss = _linear_setup()
    native = Linear.backward
    store = WeightGradStore()
    value = loss(inputs[0])
    with store.collecting(1, 0):
        assert Linear.backward is not native
        value.backward()
    assert Linear.backward is native, "the swap ends with the B node"
    loss(inputs[1]).backward()
    assert params[0].grad is not None, "outside a B node Megatron's backward is untouched"
    with pytest.raises(WeightGradError, match=r"W1\.1 has no deferred weight gradients.*pending: B0\.1"):
        store.flush(1, 1)
    with pytest.raises(WeightGradError, match=r"B0\.1 ran twice"):
        with store.collecting(1, 0):
            pass
    with pytest.raises(WeightGradError, match=r"W0\.1 did not run"):
        store.check_empty()
    store.flush(1, 0)
    store.check_empty()


def test_grouped_gemm_experts_are_refused_with_split_tables():
    """The local spec ignores moe_grouped_gemm and builds SequentialMLP; split tables refuse the flag, as
    documented, instead of running something else than asked."""
    from primuspipe.backends.megatron.compat import check_megatron_config
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
    from primuspipe.algorithms.build import build_schedule

    enable_cpu_mode()
    config = tiny_models.transformer_config(MOE, 2, 1)
    check_megatron_config(config, build_schedule("zb-h1", pp=2, microbatches=2), [torch.nn.Linear(1, 1)])
    config.moe_grouped_gemm = True  # after __post_init__, which wants Transformer Engine for it
    check_megatron_config(config, build_schedule("1f1b", pp=2, microbatches=2), [torch.nn.Linear(1, 1)])
    with pytest.raises(ConfigError, match="moe_grouped_gemm=True.*SequentialMLP"):
        check_megatron_config(config, build_schedule("zb-h1", pp=2, microbatches=2), [torch.nn.Linear(1, 1)])

