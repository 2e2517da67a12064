"""Plug-in algorithms wrong before they return anything: ``register()`` given each argument at values it cannot
mean (a name the command line could not pass or print, a placement or vpp that is none, a flag that is text), a
function whose signature ``build_schedule`` cannot call, a function that raises (each kind of exception a bug
raises), and one whose table is built on another placement than it registered. Each is one line naming the
algorithm or the argument: from ``register()`` itself, or -- for what only running shows -- from ``build_schedule``,
``primuspipe show`` and zb-auto (which draws on every registered algorithm).

Defects this family found: ``register(5)`` and ``register(None)`` registered, then ``primuspipe list``, ``show`` and
``simulate -a all`` were tracebacks; ``register("all")`` could never be picked alone (``-a all`` means every
algorithm); ``vpp="1"`` was a TypeError at every build, ``split_backward="no"`` read as true, ``placement="x"``
projected nothing with no error line; a function taking no request or a required option was a TypeError traceback
at every build, and one raising a KeyError or recursing without end was a traceback from ``show`` and from
``simulate -a zb-auto``; a table on a custom placement, or on the other built-in one, was accepted though the
projection builds an algorithm's layouts from the placement it registered.
"""

from __future__ import annotations

import itertools
import json

import pytest

from hostile_support import record, refused, run_api, run_cli
from primuspipe.algorithms import ScheduleRequest, get_algorithm, register
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable

_names = itertools.count()
GOOD = {"placement": "interleaved", "vpp": None, "split_backward": False, "default_vpp": 1}
BAD_ARGUMENTS = {
    "name": ["", " ", "all", "a b", "a\tb", "a\nb", "x\x1b[31m", "zb\u202ev", "-x", "--pp", 5, None, b"x", ("x",)],
    "placement": ["x", "V", "Interleaved", "", None, 1, True],
    "vpp": [0, -1, "2", True, 1.0, 2.5, float("nan")],
    "default_vpp": [0, -2, "1", True, 2.0, None],
    "split_backward": ["no", "yes", 0, 1, None],
}
"""Each :func:`register` argument's wrong values (the others stay :data:`GOOD`)."""
V_WITHOUT_TWO_CHUNKS = [None, 1, 3]


pytestmark = pytest.mark.usefixtures("forget_plugins")  # conftest.py


def _one_f_one_b(req: ScheduleRequest) -> ScheduleTable:
    """A plug-in that builds 1F1B."""
    return build_schedule("1f1b", req.pp, req.microbatches, communication=False)


FRESH = object()


def _register(fn, name: object = FRESH, **arguments) -> object:
    """Register ``fn`` (as a plug-in's module) under ``name``, else a fresh name; the name it got."""
    fn.__module__ = "hostile_plugin"
    name = f"hostile-plugin-{next(_names)}" if name is FRESH else name
    register(name, **{**GOOD, **arguments})(fn)
    return name


def _argument_cases():
    for argument, values in BAD_ARGUMENTS.items():
        for value in values:
            yield argument, value
    for vpp in V_WITHOUT_TWO_CHUNKS:
        yield "v placement vpp", vpp


ARGUMENT_CASES = list(_argument_cases())


@pytest.mark.parametrize("argument, value", ARGUMENT_CASES, ids=[f"{a}={v!r}" for a, v in ARGUMENT_CASES])
def test_register_arguments(argument, value):
    def call():
        fn = lambda req: _one_f_one_b(req)  # noqa: E731 - a fresh function per registration
        if argument == "name":
            return _register(fn, name=value)
        if argument == "v placement vpp":
            return _register(fn, placement="v", vpp=value)
        return _register(fn, **{argument: value})

    name = "placement" if argument == "v placement vpp" else argument
    refused(run_api(call), "register", name if argument != "name" else "name", case=f"register {argument}={value!r}")


def _signatures():
    def nothing():
        return None

    def two_positional(req, other):
        return _one_f_one_b(req)

    def required_option(req, *, width):
        return _one_f_one_b(req)

    def only_keywords(*, req=None):
        return _one_f_one_b(req)

    yield "takes no request", nothing
    yield "takes two positional parameters", two_positional
    yield "has an option without a default", required_option
    yield "takes the request by keyword only", only_keywords


SIGNATURES = list(_signatures())


@pytest.mark.parametrize("label, fn", SIGNATURES, ids=[s[0] for s in SIGNATURES])
def test_functions_build_schedule_cannot_call(label, fn):
    refused(run_api(_register, fn), "algorithm", "request" if "option" not in label else "option",
            case=f"register a function that {label}")


def _raising():
    def recurse(req):
        return recurse(req)

    def raises(kind):
        def fn(req):
            raise kind("a plug-in's own bug")
        return fn

    for kind in (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError, AssertionError,
                 RuntimeError, NotImplementedError, OverflowError, MemoryError):
        yield kind.__name__, raises(kind)
    yield "RecursionError", recurse


RAISING = list(_raising())


@pytest.mark.parametrize("label, fn", RAISING, ids=[r[0] for r in RAISING])
def test_functions_that_raise(label, fn):
    name = _register(fn)
    refused(run_api(build_schedule, name, 2, 4), name, label, case=f"build a plug-in raising {label}")
    refused(run_cli(["show", name, "--pp", 2, "-m", 4]), name, label, case=f"show a plug-in raising {label}")
    refused(run_cli(["simulate", "-a", "zb-auto", "--pp", 2, "-m", 4]), name, label,
            case=f"zb-auto beside a plug-in raising {label}")


def _placements():
    """(label, registered placement, registered vpp, the table the function returns)."""
    def built(algorithm, vpp=None):
        return lambda req: build_schedule(algorithm, req.pp, req.microbatches, vpp, communication=False)

    def reversed_stages(req):
        table = _one_f_one_b(req)
        placement = Placement("custom", tuple((req.pp - 1 - r,) for r in range(req.pp)))
        return ScheduleTable.build(placement, req.microbatches, [list(row) for row in reversed(table.ranks)], "x")

    yield "a V table registered interleaved", "interleaved", 2, built("zbv")
    yield "an interleaved table registered V", "v", 2, built("interleaved-1f1b", 2)
    yield "a custom placement registered interleaved", "interleaved", None, reversed_stages
    yield "a custom placement registered any", "any", None, reversed_stages


PLACEMENTS = list(_placements())


@pytest.mark.parametrize("label, placement, vpp, fn", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_tables_on_another_placement(label, placement, vpp, fn):
    name = _register(fn, placement=placement, vpp=vpp)
    shape = ["--pp", 2, "-m", 4, *([] if vpp is None else ["--vpp", vpp])]
    refused(run_api(build_schedule, name, 2, 4, vpp), name, "placement", case=f"build {label}")
    refused(run_cli(["show", name, *shape]), name, "placement", case=f"show {label}")
    if placement != "any":  # zb-auto draws on fixed-placement algorithms only
        refused(run_cli(["simulate", "-a", "zb-auto", "--pp", 2, "-m", 4]), name, "placement",
                case=f"zb-auto beside {label}")


SPLIT = [(algorithm, info.placement, info.vpp) for algorithm in ("zb-h1", "zb-h2", "zbv", "v-half", "dualpipe-v")
         for info in [get_algorithm(algorithm)]]


@pytest.mark.parametrize("algorithm, placement, vpp", SPLIT, ids=[s[0] for s in SPLIT])
def test_split_tables_registered_fused(algorithm, placement, vpp):
    """A plug-in registered ``split_backward=False`` (what ``list`` shows as ``BW``) returning a table with B and W
    nodes: refused naming the algorithm and the flag, from a build, ``show`` and zb-auto."""
    name = _register(lambda req: build_schedule(algorithm, req.pp, req.microbatches, communication=False),
                     placement=placement, vpp=vpp, split_backward=False)
    case = f"{algorithm}'s table registered fused"
    refused(run_api(build_schedule, name, 2, 4), name, "split_backward", case=f"build {case}")
    refused(run_cli(["show", name, "--pp", 2, "-m", 4]), name, "split_backward", case=f"show {case}")
    if placement != "any":
        refused(run_cli(["simulate", "-a", "zb-auto", "--pp", 2, "-m", 4]), name, "split_backward",
                case=f"zb-auto beside {case}")


LABELS = ["1f1b", "zb-h1", "gpipe", "custom", "zero-bubble", "another-plugin"]


@pytest.mark.parametrize("label", LABELS)
def test_tables_labelled_with_another_name(tmp_path, label):
    """A plug-in's table labelled with another algorithm's name (a wrapper of a built-in returns ``1f1b``'s own):
    what is built, exported and simulated under the plug-in's name carries that name, never the other."""
    def labelled(req):
        table = _one_f_one_b(req)
        return ScheduleTable.build(table.placement, table.microbatches, [list(r) for r in table.ranks], label)

    name = _register(labelled)
    built = build_schedule(name, 2, 4)
    record("sound" if built.algorithm == name else "silent", f"build a plug-in labelling its table {label!r}")
    assert built.algorithm == name
    outcome = run_cli(["export", name, "--pp", 2, "-m", 4, "-o", tmp_path / "t.json"])
    exported = json.loads((tmp_path / "t.json").read_text())["algorithm"] if outcome.code == 0 else None
    record("sound" if exported == name else "silent", f"export a plug-in labelling its table {label!r}")
    assert exported == name, outcome.message


def test_good_registrations_still_build():
    """The edges beside the refusals: every placement with the vpp it holds, a name with digits, dots and dashes,
    an option with a default."""
    def built(algorithm, vpp=None):
        return lambda req: build_schedule(algorithm, req.pp, req.microbatches, vpp, communication=False)

    def with_option(req, *, extra: int = 1):
        return _one_f_one_b(req)

    cases = [("a-1.b", "interleaved", None, _one_f_one_b, False),
             ("interleaved-vpp-2", "interleaved", 2, built("interleaved-1f1b", 2), False),
             ("v-plugin", "v", 2, built("zbv"), True), ("any-plugin", "any", None, built("zbv"), True),
             ("with-option", "interleaved", None, with_option, False),
             ("split-may-fuse", "interleaved", None, _one_f_one_b, True)]
    for name, placement, vpp, fn, split in cases:
        _register(fn, name, placement=placement, vpp=vpp, split_backward=split)
        outcome = run_cli(["show", name, "--pp", 2, "-m", 4])
        record("sound" if outcome.code == 0 else "refused", f"register {name} ({placement}, vpp {vpp})")
        assert outcome.code == 0, outcome.message
