"""Round fourteen: the Python functions the docs show a user calling (docs/simulator.md, docs/authoring.md,
docs/pp_vis.md §5: ``build_schedule``, ``simulate``, ``validate``, ``peak_in_flight``, pp_vis's ``load_timeline``,
``load_iterations``, ``draw_png``, ``write_html``, ``write_trace``, ``compare_timelines``, ``replay``, ``measure_costs``, ``measure_runs``;
docs/backends.md: ``cached_schedule`` and ``StepDriver.execute``; docs/torch.md: ``split_sequential``; docs/authoring.md:
``warmup_steady_cooldown``)
given each annotated parameter, in turn, at values of another type -- generated from the function's own annotations,
so a new parameter joins the sweep -- and called with an argument missing or one it does not take; the shares
(``retained``, ``offloaded``) also outside [0, 1]. Each is one PrimusPipeError line naming the parameter (or the
function), and nothing is written.

Defects this family found: ``validate(table, retained="x")`` (and ``offloaded``, ``complete``, ``retained=2.5``,
``-1``, NaN) passed silently; ``peak_in_flight(table, retained="x")`` was a TypeError and ``retained=2.5`` counted
activations past the microbatch; ``compare_timelines(run, "x")``, ``measure_costs("x")``, ``draw_png(None, path)``,
``write_html(None, path)``, ``write_trace(None, path)`` were AttributeErrors and TypeErrors; ``draw_png(...,
marks="x")`` drew with a text for marks; ``build_schedule(..., memory_limit_bytes=object())`` a TypeError in the
request; a call missing an argument was Python's TypeError; ``cached_schedule`` given its options as a list or a dict
(or a list among the values) was the cache's "unhashable type"; ``StepDriver.execute`` given the rank as ``"0"`` or
``0.0``, no table, a group of None or a name, ``record="no"`` was a TypeError or torch's ValueError at the first
transfer, and ``forward_only="no"`` (truthy) ran a forward-only step, a device of None, ``3`` (``cuda:3``) or a missing
GPU was kept, and any device but a torch.device (docs/backends.md's ``"cpu"`` too) an AttributeError once the step
recorded (round fifteen); ``split_sequential(model, "2")`` and a model that is no
``Sequential`` were TypeErrors, ``num_stages=True`` one stage; ``warmup_steady_cooldown`` refused a warm-up past its
forwards with a bare assert (under ``python -O``, a row that lost backwards)."""

from __future__ import annotations

import inspect
import math
import typing

import pytest
import torch

from hostile_support import refused, run_api, wrong_values
from primuspipe.algorithms.build import build_schedule
from primuspipe.algorithms.phases import warmup_steady_cooldown
from primuspipe.backends.torch import split_sequential
from primuspipe.calibration.measure import measure_runs
from primuspipe.ir.activations import peak_in_flight
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.node import BW, F
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.validation import validate
from primuspipe.runtime.driver import StepDriver, cached_schedule
from primuspipe.simulator import simulate
from primuspipe.tools.pp_vis import (compare_timelines, draw_png, load_iterations, load_timeline, measure_costs,
                                     replay, write_html, write_trace)

TABLE = build_schedule("1f1b", 2, 4)
COST = CostModel.per_stage(2, 1, 1, 1)
TIMELINE = simulate(TABLE, COST).timeline()


def _valid(tmp) -> dict:
    """Each function with valid arguments (an output under ``tmp``)."""
    saved = TIMELINE.save(tmp / "t.timeline.json")
    return {
        build_schedule: {"algorithm": "zb-h1", "pp": 2, "microbatches": 4, "vpp": 1, "cost": COST, "memory_limit": 4.0,
                         "memory_limit_bytes": None, "communication": True},
        simulate: {"table": TABLE, "cost": COST, "semantics": "primuspipe"},
        validate: {"table": TABLE, "max_in_flight": 4.0, "retained": 0.5, "offloaded": 1.0, "complete": True,
                   "semantics": "primuspipe"},
        peak_in_flight: {"table": TABLE, "retained": 0.5, "offloaded": 1.0},
        load_timeline: {"path": saved, "iteration": None},
        load_iterations: {"path": saved},
        draw_png: {"timelines": TIMELINE, "path": tmp / "out" / "x.png", "marks": (), "show_comm": True},
        write_html: {"timelines": TIMELINE, "path": tmp / "out" / "x.html", "marks": ()},
        write_trace: {"timeline": TIMELINE, "path": tmp / "out" / "x.json", "placement": TABLE.placement},
        compare_timelines: {"run": TIMELINE, "simulated": TIMELINE},
        replay: {"timeline": TIMELINE, "cost": COST, "placement": TABLE.placement},
        measure_costs: {"timelines": [TIMELINE], "placement": TABLE.placement, "warmup": 1},
        measure_runs: {"runs": [[TIMELINE]], "placement": TABLE.placement, "warmup": 1},
        cached_schedule: {"algorithm": "interleaved-1f1b", "pp": 2, "vpp": 2, "microbatches": 4,
                          "options": (("microbatch_group_size", 2),)},
        split_sequential: {"model": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), "num_stages": 2},
        warmup_steady_cooldown: {"forwards": [F(0), F(1)], "backwards": [BW(0), BW(1)], "warmup": 1},
    }


FUNCTIONS = [build_schedule, simulate, validate, peak_in_flight, load_timeline, load_iterations, draw_png, write_html,
             write_trace, compare_timelines, replay, measure_costs, measure_runs, cached_schedule, split_sequential,
             warmup_steady_cooldown]
SHARES = {validate: ("retained", "offloaded"), peak_in_flight: ("retained", "offloaded")}
"""Parameters that are a share of a microbatch's activations: [0, 1]."""
RANGES = {(warmup_steady_cooldown, "warmup"): [-1, 3], (split_sequential, "num_stages"): [0, 3]}
"""Integer parameters at values just outside what their other arguments allow."""


def _hints(fn) -> dict:
    """The annotated parameters of ``fn`` (the undecorated function's, resolved)."""
    hints = typing.get_type_hints(inspect.unwrap(fn), localns={"ScheduleTable": ScheduleTable})  # a TYPE_CHECKING name
    return {name: hint for name, hint in hints.items() if name not in ("return", "self") and hint is not typing.Any
            and not getattr(hint, "_is_protocol", False)}  # a binder (a Protocol) is the runner's to check


def _cases():
    for fn in FUNCTIONS:
        for name, hint in _hints(fn).items():
            values = wrong_values(hint) + ([2.5, -0.1, math.nan] if name in SHARES.get(fn, ()) else []) + \
                RANGES.get((fn, name), [])
            for i, value in enumerate(values):
                yield f"{fn.__name__} {name}={value!r:.20}#{i}", fn, name, value


CASES = list(_cases())


@pytest.mark.parametrize("case, fn, name, value", CASES, ids=[c[0] for c in CASES])
def test_an_argument_of_another_type(tmp_path, case, fn, name, value):
    kwargs = {**_valid(tmp_path)[fn], name: value}
    refused(run_api(fn, **kwargs), name, case=f"API {case}")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), f"{case}: wrote a file"


@pytest.mark.parametrize("fn", FUNCTIONS, ids=[f.__name__ for f in FUNCTIONS])
def test_a_call_missing_an_argument_or_with_one_it_does_not_take(tmp_path, fn):
    valid = _valid(tmp_path)[fn]
    first = next(iter(valid))
    refused(run_api(fn, **{k: v for k, v in valid.items() if k != first}), fn.__name__, first,
            case=f"API {fn.__name__} without {first}")
    if fn is not build_schedule:  # build_schedule's other keywords are the algorithm's options (refused by name)
        refused(run_api(fn, **valid, colour="red"), fn.__name__, "colour", case=f"API {fn.__name__} colour=red")


@pytest.mark.parametrize("fn", FUNCTIONS, ids=[f.__name__ for f in FUNCTIONS])
def test_the_valid_arguments_are_accepted(tmp_path, fn):
    """The arguments each case above changes one of are themselves valid: the refusal is the wrong value's."""
    fn(**_valid(tmp_path)[fn])


class _Binder:
    """The smallest binder of a one-rank 1F1B table (docs/backends.md's shape)."""

    def __init__(self):
        import torch

        self.handlers = {NodeKind.F: lambda call: torch.ones(1, requires_grad=True), NodeKind.BW: lambda call: None}

    def recv_buffer(self, node):
        raise AssertionError("a one-rank table receives nothing")

    def local_handoff(self, tensor, carries):
        return tensor

    def sent(self, node, tensor):
        pass


def _execute_cases():
    valid = {"table": None, "rank": 0, "binder": None, "group": None, "device": "cpu", "forward_only": False,
             "record": False, "dump_meta": None}
    for name, hint in _hints(StepDriver.execute).items():
        for i, value in enumerate(wrong_values(hint)):
            yield f"StepDriver.execute {name}={value!r:.20}#{i}", {**valid, name: value}, name
    for i, value in enumerate([None, "world", 3]):
        yield f"StepDriver.execute group={value!r}#{i}", {**valid, "group": value}, "group"
    for i, value in enumerate(_absent_devices()):
        for record in (False, True):
            yield f"StepDriver.execute device={value!r} record={record}#{i}", {**valid, "device": value,
                                                                                "record": record}, "device"


def _absent_devices() -> list:
    """Devices ``execute`` cannot run on here: no device at all, a name torch cannot read, and the first GPU past
    the visible ones in each spelling (torch reads a bare integer as ``cuda:N``). Each was kept without a word,
    or was an AttributeError once the step recorded (``"cpu"`` too, docs/backends.md's own spelling)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [None, "gpu", 2.5, ["cpu"], object(), True, visible, f"cuda:{visible}",
            torch.device("cuda", visible)]


EXECUTE_CASES = list(_execute_cases())


@pytest.mark.parametrize("case, kwargs, name", EXECUTE_CASES, ids=[c[0] for c in EXECUTE_CASES])
def test_a_step_driver_argument_of_another_type(one_rank_group, case, kwargs, name):
    """``StepDriver.execute`` (docs/backends.md's minimal backend) refuses before any node runs."""
    import torch.distributed as dist

    defaults = {"table": cached_schedule("1f1b", 1, 1, 2), "binder": _Binder(), "group": dist.group.WORLD}
    kwargs = {k: defaults[k] if v is None and k in defaults and k != name else v for k, v in kwargs.items()}
    refused(run_api(StepDriver(watchdog_timeout_s=20).execute, **kwargs), name, case=f"API {case}")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["'cpu'", "torch.device"])
@pytest.mark.parametrize("record", [False, True])
def test_the_step_driver_runs_the_valid_arguments(one_rank_group, device, record):
    """The device as docs/backends.md spells it, or a torch.device, with and without recording the step (the
    recorder is what reads the device: ``"cpu"`` was an AttributeError there)."""
    import torch.distributed as dist

    timeline = StepDriver(watchdog_timeout_s=20).execute(cached_schedule("1f1b", 1, 1, 2), 0, _Binder(),
                                                         dist.group.WORLD, device=device, record=record)
    assert (timeline is not None) == record
