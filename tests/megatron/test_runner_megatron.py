"""primuspipe tables inside real megatron-core (CPU, gloo): losses and every gradient equal Megatron's
native schedule (bitwise for the same algorithm), or a pp=1 run where Megatron refuses the shape;
forward_only gives the same losses; a full DDP + optimizer step matches; the compute order Megatron's
interleaved schedule really executes is primuspipe's interleaved-1f1b table; dumps are timelines.

One gloo launch per (pp, vpp) runs all of that layout's cases.
"""

import dataclasses
import functools
import importlib.util
import inspect
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from megatron_harness import assert_same_tensors, merged, pp1_references, stacked_losses  # noqa: E402

from primuspipe.backends.megatron import install, is_installed, uninstall  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402
from primuspipe.io.run_dumps import merge_rank_dumps  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.ir.node import NodeKind  # noqa: E402
from primuspipe.algorithms.build import build_schedule  # noqa: E402

GPT8 = tiny_models.TINY_MODELS["tiny-gpt"]
GPT6 = dataclasses.replace(GPT8, num_layers=6)
MOE = tiny_models.TINY_MODELS["tiny-moe"]
GROUP = "microbatch_group_size_per_vp_stage"


@dataclasses.dataclass(frozen=True)
class Case:
    algorithm: str
    m: int
    reference: str = "native"
    """"native": Megatron's own schedule in the same run; "pp1": a pp=1 run (Megatron refuses the shape)."""
    model: tiny_models.TinyModelConfig = GPT8
    train: bool = False
    """DDP + finalize_model_grads + SGD step."""
    overrides: tuple = ()

    @property
    def id(self):
        extra = "-train" if self.train else ""
        extra += "-moe" if self.model is MOE else ""
        extra += "".join(f"-g{v}" for k, v in self.overrides if k == GROUP)
        return f"{self.algorithm}-m{self.m}{extra}"

    def spec(self, forward_only=False):
        return compare.StepSpec(self.model, self.m, ddp=self.train, optimizer_step=self.train,
                                forward_only=forward_only, config_overrides=dict(self.overrides))


CASES = {
    ParallelLayout(2): [Case("gpipe", 1), Case("gpipe", 3), Case("1f1b", 1), Case("1f1b", 3), Case("1f1b", 4),
                        Case("1f1b", 3, model=MOE), Case("1f1b", 4, train=True), Case("gpipe", 3, train=True)],
    ParallelLayout(3): [Case("gpipe", 2, model=GPT6), Case("gpipe", 5, model=GPT6), Case("1f1b", 2, model=GPT6),
                        Case("1f1b", 5, model=GPT6)],
    ParallelLayout(4): [Case("gpipe", 3), Case("1f1b", 3), Case("1f1b", 6), Case("1f1b", 5, train=True)],
    ParallelLayout(2, vpp=2): [Case("gpipe", 1, "pp1"), Case("gpipe", 4), Case("interleaved-1f1b", 1, "pp1"),
                               Case("interleaved-1f1b", 3, overrides=((GROUP, 3),)), Case("interleaved-1f1b", 4),
                               Case("interleaved-1f1b", 4, train=True)],
    ParallelLayout(4, vpp=2): [Case("gpipe", 3, "pp1"), Case("interleaved-1f1b", 2, "pp1"),
                               Case("interleaved-1f1b", 3, "pp1"), Case("interleaved-1f1b", 4),
                               Case("interleaved-1f1b", 9, overrides=((GROUP, 5),)),
                               Case("interleaved-1f1b", 8, train=True)],
}

# Shapes whose executed compute order is recorded from Megatron's native schedule.
ORDER_SHAPES = {ParallelLayout(2, vpp=2): (4, 6), ParallelLayout(4, vpp=2): (4, 8), ParallelLayout(4): (6,)}


class _OrderProbe:
    """Wraps megatron's forward_step/backward_step to log (kind, microbatch, chunk) as executed; a
    backward is identified by the identity of the output tensor its forward returned."""

    def __init__(self, schedules):
        self.schedules, self.log, self._owner = schedules, [], {}
        self._f, self._b = schedules.forward_step, schedules.backward_step

    def __enter__(self):
        def forward_step(*args, **kwargs):
            out = self._f(*args, **kwargs)
            key = (kwargs["current_microbatch"], kwargs.get("vp_stage") or 0)
            self._owner[id(out[0])] = key
            self.log.append(("F", *key))
            return out

        def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
            self.log.append(("BW", *self._owner.pop(id(output_tensor))))
            return self._b(input_tensor, output_tensor, output_tensor_grad, config)

        self.schedules.forward_step, self.schedules.backward_step = forward_step, backward_step
        return self

    def __exit__(self, *exc):
        self.schedules.forward_step, self.schedules.backward_step = self._f, self._b


def _worker(layout, dump_dir, ctx):
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    pp, vpp = layout.pp, layout.vpp
    out = {}
    for case in CASES[layout]:
        ours = PrimusForwardBackward(PrimusPipeConfig(True, case.algorithm))
        row = {"ours": compare.run_step(ours, case.spec(), pp, vpp),
               "ours_fwd": compare.run_step(ours, case.spec(forward_only=True), pp, vpp)}
        if case.reference == "native":
            row["native"] = compare.run_step(get_forward_backward_func(), case.spec(), pp, vpp)
        out[case.id] = row
    orders = {}
    for m in ORDER_SHAPES.get(layout, ()):
        for name, schedule in (("native", get_forward_backward_func()),
                               ("ours", PrimusForwardBackward(PrimusPipeConfig(True, "auto")))):
            with _OrderProbe(schedules) as probe:
                compare.run_step(schedule, compare.StepSpec(GPT8, m), pp, vpp)
            orders[(name, m)] = probe.log
    out["orders"] = orders
    if layout == ParallelLayout(2):
        dump = PrimusForwardBackward(PrimusPipeConfig(True, "1f1b", dump_pp_data=True, dump_dir=dump_dir))
        for _ in range(2):
            compare.run_step(dump, compare.StepSpec(GPT8, 3), pp, vpp)
    return out


@functools.lru_cache(maxsize=None)
def _run(layout, dump_dir=""):
    return run_on_gloo(functools.partial(_worker, layout, dump_dir), layout, timeout_s=300)


PP1_KEYS = frozenset((c.model, c.m, c.train) for cases in CASES.values() for c in cases if c.reference == "pp1")


PARAMS = [pytest.param(layout, case, id=f"pp{layout.pp}-vpp{layout.vpp}-{case.id}")
          for layout, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("layout,case", PARAMS)
def test_table_matches_megatron(layout, case, tmp_path_factory):
    results = _run(layout, str(tmp_path_factory.getbasetemp() / "dumps") if layout == ParallelLayout(2) else "")
    last = results[-1][case.id]
    assert all(r[case.id]["ours"].losses == [] for r in results[:-1]), "only the last stage reports losses"
    if case.reference == "native":
        want_losses = stacked_losses(last["native"])
        want_grads, want_params = (merged(results, case.id, "native", a) for a in ("grads", "params"))
        bitwise = case.algorithm in ("1f1b", "interleaved-1f1b")  # the same arithmetic in the same order
    else:
        ref = pp1_references(PP1_KEYS)[(case.model, case.m, case.train)]
        want_losses, want_grads, want_params, bitwise = stacked_losses(ref), ref.grads, ref.params, False
    got_losses = stacked_losses(last["ours"])
    assert len(got_losses) == case.m
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=1e-6)
    assert_same_tensors(merged(results, case.id, "ours", "grads"), want_grads, "grad", bitwise=bitwise)
    if case.train:
        assert_same_tensors(merged(results, case.id, "ours", "params"), want_params, "param after optimizer step",
                            bitwise=bitwise)
    assert torch.equal(stacked_losses(last["ours_fwd"]), got_losses), "forward_only gives the training losses"
    assert all(g is None or not g.any() for r in results for g in r[case.id]["ours_fwd"].grads.values())


@pytest.mark.parametrize("layout", list(ORDER_SHAPES), ids=lambda lay: f"pp{lay.pp}-vpp{lay.vpp}")
def test_megatron_native_compute_order_is_the_table(layout):
    results = _run(layout, "")
    for m in ORDER_SHAPES[layout]:
        algorithm = "1f1b" if layout.vpp == 1 else "interleaved-1f1b"
        table = build_schedule(algorithm, layout.pp, m, layout.vpp, communication=False)
        for rank, result in enumerate(results):
            want = [(n.kind.name, n.microbatch, n.chunk) for n in table.ranks[rank]]
            assert result["orders"][("native", m)] == want, f"rank {rank}, m={m}: Megatron's executed order"
            assert result["orders"][("ours", m)] == want, f"rank {rank}, m={m}: primuspipe's executed order"


def test_dump_pp_data_writes_run_timelines(tmp_path_factory):
    dump_dir = tmp_path_factory.getbasetemp() / "dumps"
    _run(ParallelLayout(2), str(dump_dir))
    table = build_schedule("1f1b", pp=2, microbatches=3)
    for iteration in (0, 1):
        timeline = merge_rank_dumps(dump_dir, iteration)
        assert (timeline.source, timeline.algorithm, timeline.pp, timeline.iteration) == ("run", "1f1b", 2, iteration)
        for rank in timeline.ranks:
            assert sorted(str(e.node) for e in rank.events) == sorted(str(n) for n in table.ranks[rank.rank])
            assert all(0 <= e.start <= e.end for e in rank.events)
            assert rank.peak_memory_bytes > 0
            computes = [e for e in rank.events if e.node.kind.is_compute]
            assert all(a.end <= b.start for a, b in zip(computes, computes[1:])), "compute nodes run one at a time"
        recv = next(e for e in timeline.ranks[1].events if e.node.kind is NodeKind.RECV_F)
        assert recv.end > 0 and timeline.step_time > 0


def test_signature_matches_megatron():
    from megatron.core.pipeline_parallel import schedules

    ours = list(inspect.signature(PrimusForwardBackward.__call__).parameters.values())[1:]
    for native in (schedules.forward_backward_pipelining_without_interleaving,
                   schedules.forward_backward_pipelining_with_interleaving):
        theirs = list(inspect.signature(native).parameters.values())
        assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


def test_install_patches_every_binding_and_uninstall_restores():
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()  # megatron's pipeline package imports triton (stubbed in CPU mode)
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    native = schedules.get_forward_backward_func
    saved = sys.modules.get("megatron.training.training")
    training = types.ModuleType("megatron.training.training")  # stands in for Megatron-LM's training loop
    training.get_forward_backward_func = native
    sys.modules["megatron.training.training"] = training
    try:
        assert install(PrimusPipeConfig(patch_primus_pipeline=False)) is None and not is_installed()
        func = install(PrimusPipeConfig(), patch_primus_pipeline=True, pp_algorithm="gpipe")
        assert isinstance(func, PrimusForwardBackward) and is_installed()
        for module in (pipeline_parallel, schedules, training):
            assert module.get_forward_backward_func(pp_size=4, vp_size=None) is func
        assert pipeline_parallel.get_forward_backward_func(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    finally:
        uninstall()
        del sys.modules["megatron.training.training"]
        if saved is not None:
            sys.modules["megatron.training.training"] = saved
    assert pipeline_parallel.get_forward_backward_func is native and schedules.get_forward_backward_func is native
    assert training.get_forward_backward_func is native


def test_uninstall_restores_megatron_training_imported_after_install():
    """megatron.training.training binds get_forward_backward_func when it is imported; imported after
    install() it holds primuspipe's, which uninstall() must put back too."""
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    native = schedules.get_forward_backward_func
    saved = sys.modules.pop("megatron.training.training", None)
    try:
        install(PrimusPipeConfig(patch_primus_pipeline=True, pp_algorithm="zbv"))
        training = types.ModuleType("megatron.training.training")
        training.get_forward_backward_func = pipeline_parallel.get_forward_backward_func  # its `from ... import`
        sys.modules["megatron.training.training"] = training
        uninstall()
        assert training.get_forward_backward_func is native and not is_installed()
    finally:
        uninstall()
        sys.modules.pop("megatron.training.training", None)
        if saved is not None:
            sys.modules["megatron.training.training"] = saved
