"""The hostile-input sweep's harness: run one bad input, sort what happened into one of the sweep's
classes, and assert it is the only acceptable one.

Classes (the issue's): ``clear`` -- refused, non-zero exit (or the project's exception for an API entry
point), one line naming the problem; ``garbled`` -- refused, but the message is not one line or does
not name the problem; ``traceback`` -- an exception escaped; ``silent`` -- exit 0 or no exception on bad
input; ``hang`` -- still running after :data:`HANG_S`; ``late`` -- refused, but only after the work the
refusal should have prevented (drawing, simulating, measuring, a training step: :data:`WORK`);
``leftover`` -- refused, but files were left behind in the folder the case watches. Valid inputs near
the edges are tallied as ``sound`` when they are accepted and ``refused`` when they are not. Every outcome is tallied and the tally printed at
the end of the session (``hostile inputs: ...``), the figure the issue's closing note asks for.
"""

from __future__ import annotations

import argparse
import collections.abc
import contextlib
import io
import json
import math
import os
import signal
import traceback
import types
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from primuspipe.cli import build_parser, main
from primuspipe.errors import PrimusPipeError
from primuspipe.io.timeline import dump_path

HANG_S = 30
"""An input still being handled after this long counts as a hang (every clear refusal takes well under 1 s)."""

KINDS = ("clear", "sound", "garbled", "traceback", "silent", "late", "leftover", "hang", "refused")
TALLY: Counter = Counter()
CASES: list[tuple[str, str]] = []


class _Hang(BaseException):
    pass


@contextlib.contextmanager
def _hang_guard():
    def alarm(signum, frame):
        raise _Hang()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    kind: str
    """clear, garbled, traceback, silent or hang."""
    code: int | None
    message: str
    """The error line (CLI) or the exception's first line (API)."""
    out: str = ""
    err: str = ""
    work: tuple[str, ...] = ()
    """The work functions (:data:`WORK`) that ran before the command ended."""
    left: tuple[str, ...] = ()
    """Files that appeared in or changed under the watched folder."""


def _error_lines(err: str) -> list[str]:
    """stderr lines that are error messages: ``error: ...`` (ours) or ``primuspipe X: error: ...`` (argparse)."""
    return [line for line in err.splitlines() if line.startswith("error: ") or ": error: " in line]


WORK = (("primuspipe.cli.simulate_command", "simulate"), ("primuspipe.cli.simulate_command", "write_chrome_trace"),
        ("primuspipe.cli.vis_command", "measure_screened"), ("primuspipe.cli.vis_command", "write_trace"),
        ("primuspipe.tools.pp_vis.png", "draw_png"), ("primuspipe.tools.pp_vis.html", "write_html"),
        ("primuspipe.runtime.driver.StepDriver", "execute"))
"""Functions that do a command's work: a refusal of bad input or output after any of them ran is late."""


@contextlib.contextmanager
def _watch_work():
    import importlib

    called: list[str] = []
    saved = []
    for where, name in WORK:
        module, _, cls = where.rpartition(".") if where.endswith("StepDriver") else (where, "", "")
        owner = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
        real = getattr(owner, name)

        def probe(*args, _real=real, _name=name, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        saved.append((owner, name, real))
        setattr(owner, name, probe)
    try:
        yield called
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def _snapshot(folder: Path | None) -> dict[str, tuple[int, int]]:
    if folder is None or not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def run_cli(argv: list, watch: Path | None = None) -> Outcome:
    """``primuspipe ARGV`` in this process, classified; files that appear or change under ``watch``
    make a refusal ``leftover``."""
    before = _snapshot(watch)
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    escaped = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _watch_work() as called:
        try:
            with _hang_guard():
                try:
                    code = main([str(a) for a in argv])
                except SystemExit as exc:  # argparse
                    code = exc.code if isinstance(exc.code, int) else 1
        except _Hang:
            return Outcome("hang", None, "", out.getvalue(), err.getvalue())
        except BaseException:  # noqa: BLE001 - the sweep's "traceback" class
            escaped = traceback.format_exc()
    after = _snapshot(watch)
    left = tuple(sorted(k for k in after if before.get(k) != after[k]))
    out_text, err_text = out.getvalue(), err.getvalue()
    work = tuple(called)
    if escaped is not None or "Traceback (most recent call last)" in out_text + err_text:
        return Outcome("traceback", code, escaped or err_text, out_text, err_text, work, left)
    if code == 0:
        return Outcome("silent", code, "", out_text, err_text, work, left)
    lines = _error_lines(err_text)
    # validate reports an invalid table on stdout (its result), first line "INVALID <file>: <why>"
    invalid = [line for line in out_text.splitlines() if line.startswith("INVALID ")]
    message = (lines or invalid or [""])[0]
    kind = "clear" if len(lines) + len(invalid) == 1 and message.strip() else "garbled"
    if kind == "clear" and left:
        kind = "leftover"
    return Outcome(kind, code, message, out_text, err_text, work, left)


def run_api(fn, *args, **kwargs) -> Outcome:
    """``fn(*args, **kwargs)``, an API entry point that must raise a PrimusPipeError, classified; one
    raised after a step started running nodes (:data:`WORK`) is ``late``."""
    return _classified(fn, args, kwargs, in_step=False)


def run_in_step(fn, *args, **kwargs) -> Outcome:
    """:func:`run_api` for what only a running step can see -- what the user's code returns while the step
    runs it (a forward step function, a loss function, a binder's handlers): a refusal raised inside the
    step is ``clear``, as early as it can be."""
    return _classified(fn, args, kwargs, in_step=True)


def _classified(fn, args, kwargs, in_step: bool) -> Outcome:
    with _watch_work() as called:
        try:
            with _hang_guard():
                fn(*args, **kwargs)
        except _Hang:
            return Outcome("hang", None, "")
        except PrimusPipeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            kind = "late" if called and not in_step else "clear" if first.strip() else "garbled"
            return Outcome(kind, 1, first, work=tuple(called))
        except BaseException:  # noqa: BLE001
            return Outcome("traceback", None, traceback.format_exc(), work=tuple(called))
    return Outcome("silent", 0, "", work=tuple(called))


def record(kind: str, case: str) -> None:
    """Tally one input's class (what :func:`refused` does; for checks made in a subprocess)."""
    TALLY[kind] += 1
    CASES.append((case, kind))


def refused(outcome: Outcome, *names: str, case: str = "", before_work: bool = False) -> Outcome:
    """Tally ``outcome`` and assert the sweep's rule: a clear refusal whose message names each of ``names``
    (with ``before_work``: made before any of :data:`WORK` ran, else it is ``late``)."""
    if before_work and outcome.kind == "clear" and outcome.work:
        outcome = Outcome("late", outcome.code, outcome.message, outcome.out, outcome.err, outcome.work, outcome.left)
    record(outcome.kind, case)
    assert outcome.kind == "clear", f"{case}: {outcome.kind}: {outcome.message or outcome.out or outcome.err}"
    for name in names:
        assert name.lower() in outcome.message.lower(), f"{case}: the message does not name {name!r}: {outcome.message}"
    return outcome


def not_valid_afterwards(*paths: Path) -> None:
    """Nothing a later command would read as valid was left at ``paths``: absent, or refused when read."""
    from primuspipe.io.formats import load_table
    from primuspipe.simulator import read_cost_file

    for path in map(Path, paths):
        if not path.exists() or path.is_dir() and not any(path.iterdir()):
            continue
        if path.suffix in (".yaml", ".yml"):
            with pytest.raises(PrimusPipeError):
                read_cost_file(path)
        else:
            with pytest.raises(PrimusPipeError):
                load_table(path)


def accepted(outcome: Outcome, case: str = "") -> Outcome:
    """Tally a valid input near the edges: ``sound`` when it ran (exit 0, no error line), else ``refused``."""
    ok = outcome.kind == "silent" and outcome.code == 0
    record("sound" if ok else "refused", case)
    assert ok, f"{case}: a valid input was {outcome.kind}: {outcome.message or outcome.err}"
    return outcome


def _finite(data) -> bool:
    if isinstance(data, float):
        return math.isfinite(data)
    if isinstance(data, dict):
        return all(_finite(v) for v in data.values())
    if isinstance(data, list):
        return all(_finite(v) for v in data)
    return True


def projected_or_named(outcome: Outcome, case: str, *names: str) -> None:
    """``project --json``'s rule: exit 0 with finite figures (every candidate projected), or a clear refusal naming
    ``names`` -- never a per-algorithm "not projected" list in place of an error line."""
    if outcome.code == 0 and outcome.kind == "silent":
        report = json.loads(outcome.out)
        accepted(outcome, case=case)
        assert report["results"] and not report["refused"], f"{case}: {report['refused']}"
        assert _finite(report), f"{case}: a figure is not a number"
        return
    refused(outcome, *names, case=case)


def write_summary(terminalreporter) -> None:
    """Print the tally (and write it to ``$HOSTILE_TALLY_JSON`` as JSON when set)."""
    if not CASES:
        return
    parts = ", ".join(f"{TALLY[k]} {k}" for k in KINDS)
    terminalreporter.write_line(f"hostile inputs: {len(CASES)} ({parts})")
    if path := os.environ.get("HOSTILE_TALLY_JSON"):
        Path(path).write_text(json.dumps({"inputs": len(CASES), **{k: TALLY[k] for k in KINDS}}, indent=1))


# -- run dumps as the recorder writes them ------------------------------------------------------------
PP = 4


def _rank_files(run_id="run-a", pp=PP, iteration=0, t0=1000.0, algorithm="1f1b", microbatches=8):
    """One iteration's rank dump files, as the recorder writes them: (rank, JSON dict)."""
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.ir.cost_model import CostModel
    from primuspipe.simulator import simulate

    table = build_schedule(algorithm, pp=pp, microbatches=microbatches)
    timeline = simulate(table, CostModel.per_stage(table.num_stages, 0.01, 0.01, 0.01)).timeline()
    data = timeline.to_dict()
    for r in data["ranks"]:
        yield r["rank"], {**data, "source": "run", "iteration": iteration, "time_unit": "s", "ranks": [r],
                          "meta": {"t0_unix": t0 + iteration, "run_id": run_id}}


def make_dump(root, iterations=(0, 1), run_id="run-a", pp=PP, ranks=None, t0=1000.0, algorithm="1f1b", microbatches=8):
    for i in iterations:
        for rank, data in _rank_files(run_id, pp, i, t0, algorithm, microbatches):
            if ranks is None or rank in ranks:
                path = dump_path(root, i, rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(data))
    return root


def make_primus_dump(folder, edit=None):
    """A Primus run's dump folder (``config.json``, ``pp_rank_<r>.json`` keyed by iteration "1" and "2") of a simulated
    1F1B step at pp = :data:`PP`, 8 microbatches; ``edit`` changes rank 1's record in place."""
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.ir.cost_model import CostModel
    from primuspipe.simulator import simulate

    timeline = simulate(build_schedule("1f1b", PP, 8), CostModel.per_stage(PP, 1.0, 1.0, 1.0)).timeline()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"pp_size": PP, "vp_size": 1, "num_mbs": 8}))
    for rt in timeline.ranks:
        record = {"total": 1.0, "memory": 1.0}
        for name, kinds in (("fwd", "F"), ("bwd", "BW")):
            events = [e for e in rt.events if str(e.node.kind) == kinds]
            record.update({f"{name}_start": [e.start for e in events], f"{name}_end": [e.end for e in events],
                           f"{name}_minibatch": [e.node.microbatch for e in events],
                           f"{name}_chunk": [0 for _ in events]})
        if edit is not None and rt.rank == 1:
            edit(record)
        (folder / f"pp_rank_{rt.rank}.json").write_text(json.dumps({"1": record, "2": record}))
    return folder


# -- the command line's own description ----------------------------------------------------------------
NUMBER_TYPES = ("integer", "number", "numbers_type", "count")
"""Name prefixes of the option types that read numbers (:mod:`primuspipe.cli.options`)."""


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, so generators sweep every option the command line has."""
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def command_inputs(tmp: Path) -> Path:
    """A folder of the inputs the commands read, made by the commands themselves: a table (``table.json``), a
    simulation (``sim/``) and a run dump (``dump/``)."""
    assert run_cli(["export", "1f1b", "--pp", "2", "-m", "4", "-o", tmp / "table.json"]).code == 0
    assert run_cli(["simulate", "-a", "1f1b", "--pp", "2", "-m", "4", "-o", tmp / "sim"]).code == 0
    make_dump(tmp / "dump")
    return tmp


def small_gpt_arguments(layers: int, pp: int, extra: str = "") -> str:
    """A launcher line of a small GPT on one 8-GPU node, for the argument-list door's cases: ``extra`` is the
    argument under test."""
    return ("torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py "
            f"--num-layers {layers} --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
            "--max-position-embeddings 2048 --vocab-size 32000 --micro-batch-size 1 --global-batch-size 64 --bf16 "
            f"--pipeline-model-parallel-size {pp} {extra}")


# -- values of the wrong type, from an annotation ------------------------------------------------------
class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


_CONTAINERS = (collections.abc.Sequence, collections.abc.Collection, collections.abc.Iterable)


def _is(value, hint) -> bool:
    """Whether ``value`` is of the simple ``hint`` (a union's member): what a union's other wrong values must not be."""
    origin = typing.get_origin(hint)
    if origin is tuple or origin in _CONTAINERS:
        item = typing.get_args(hint)[0]
        return isinstance(value, (tuple, list)) and all(_is(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def wrong_values(hint) -> list:
    """Values that are not of ``hint`` (a field's or a parameter's annotation): other types, and for numbers NaN --
    generated from the annotation, so a new field or parameter joins a sweep that uses it."""
    args, origin = typing.get_args(hint), typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return [v for arg in args if arg is not type(None) for v in wrong_values(arg)
                if not any(_is(v, other) for other in args if other is not arg)]
    if origin is tuple:
        item = wrong_values(args[0])[0] if args[-1] is Ellipsis else None
        return ["12", 3, {"a": 1}, _Opaque(), *([] if item is None else [(item,)]),
                *([(math.nan,)] if args[0] is float else []), *([()] if args[-1] is not Ellipsis else [])]
    if origin in _CONTAINERS:
        return ["ab", 3, None, _Opaque(), [_Opaque()]]
    if isinstance(origin, type):  # Mapping[str, Any] and other generics: values of another kind
        return [3, "x", [1], _Opaque()]
    if hint is float:
        return ["1", None, True, [1.0], _Opaque(), math.nan]
    if hint is int:
        return [2.5, "1", True, None, _Opaque()]
    if hint is str:
        return [3, None, b"x", ["x"], _Opaque()]
    if hint is bool:
        return ["no", 1, None]
    return [3, "x", {}, None, _Opaque()]
