"""Does the simulator predict real runs? Calibrate from 1F1B alone, predict other algorithms, run them.

    python bench/bench_prediction.py [--runs 3] [--iterations 8] [--microbatches 8] [--hidden 256] [--held-out 1 4]
                                     [--lock FILE] [--keep DIR [--reuse]] [-o bench/results/prediction.json]

For pp = 2 and pp = 4 (``--pp``; pp = 3 with ``--layers 12``; megatron-core GPT on CPU, gloo ranks of one thread each through the Megatron
CPU harness, primuspipe's schedules with ``dump_pp_data``), each run is one session that trains a
model per algorithm -- 1f1b, zb-h1, zbv, interleaved-1f1b, v-half -- a step of each in turn, so every
algorithm meets the machine in the same state (on a shared machine the speed drifts by ten percent
from minute to minute); a barrier starts every step on all ranks together, as a synchronising
optimizer step does. ``--runs`` sessions per pp. Then

* **calibrate** from the 1f1b dumps only (their runs carry ``--split-probe`` probes, by default five BW
  per chunk run as B and W, two Ws right after their B and the others deferred past the next B, so the
  file has real B and warm and cold W times; ``--split-probe 0`` halves BW instead):
  ``primuspipe.calibration.measure.measure_runs`` over all their iterations (each session's first dropped), written as the portable
  cost file ``primuspipe calibrate`` writes (without step gaps: steps start together here);
* **predict** with ``primuspipe simulate --cost FILE --plan-cost unit -a all --json``, the command a user
  runs: the runs' cost-aware algorithms plan with unit costs (the Megatron backend given no costs), so
  the simulator times the tables they ran (checked: each run's node order is its table's);
* **held-out shapes** (``--held-out 1 4``: m = pp and 4pp): every session also runs 1F1B (without probe)
  and every predicted algorithm at those microbatch counts, predicted from the same cost file,
  calibrated at ``--microbatches`` only -- shapes the file was not measured at (run the bench again
  with another ``--hidden`` for a second model size);
* **compare models**: each prediction is also made from the same file without ``compute.fixed`` /
  ``compute.chunk`` (each 1F1B stage's time cut evenly over its chunks, what a backend that cannot time the
  layers gets), so the two are judged on the same runs;
* **the calibration row**: the 1F1B steps at ``--microbatches`` ran the probed table, not plain 1F1B; their
  row is that table replayed under the file those steps calibrated (``"role": "calibration replay: ..."``
  in the JSON, ``1f1b + probe (calibration replay)`` in the table), which says the file reproduces its
  source, and it is left out of ``max_abs_error`` (every other row is a prediction; plain 1F1B is predicted
  at the held-out counts);
* **measure** each algorithm's step: the dump's step span (first node start to last node end over all
  ranks, what the simulator predicts), median over a session's iterations after the first, then the
  median over sessions; the bubble rate likewise (worst rank's ``(step - busy) / step``);
* **diagnose** each run: its node order replayed under a file calibrated from its own dump
  (``own_cost_error``: what is left to the simulator given exact node costs) and, per kind and model
  stage, what the 1F1B file charges the run's nodes over what the run's own file does, each node priced in
  its context as the simulator prices it (``node_cost_errors``: which costs a 1F1B run
  mis-states for this layout), per session in each row's ``diagnosis``;
* **slow moments**: with three sessions or more, a session whose 1F1B calibration step lies outside the
  sessions' robust band (``primuspipe.calibration.runs``: modified z-score over 3.5, at least about 5 %
  off their median) met a slow or free moment of the host; it is left out of the median errors (printed,
  ``sessions_left_out`` in the JSON; its errors stay in ``session_errors``) and out of the pooled file.

``--keep-freed-memory`` makes the ranks keep the memory they free (:mod:`primuspipe.testing.host_memory`, as
a GPU's caching allocator does): with glibc's default a node that needs more memory than its process
still holds pays page faults for it, which the split probe's windows and ZB-H1's last rank do and 1F1B's
steady nodes do not. Measured both ways (docs/simulator.md), it took the probe window's share from 5-9 %
to 0-2 % but did not make the predictions better overall (pp = 2 better, pp = 3 worse), so the default
stays glibc's and the flag says which one a result used (``host_memory`` in the JSON).

The GPT is tiny-gpt widened (``--hidden 256 --seq 64``, 8 layers, micro-batch 4): at the example's
hidden size of 16 a node is mostly Python and a split backward's B + W costs a quarter more than the
fused BW (6 % at hidden 128, under 1 % at 256 with pp = 2), a cost no 1F1B run can show; here compute
dominates as in real training. Before each session
the bench waits (up to ``--quiet-wait`` s) for the CPUs to be idle, and it measures how much CPU other
processes took during it (the host's busy time less its own and its children's); a session where they
took more than ``--max-external`` cores is done again (up to ``--retries`` times) and the figure is
kept in the results either way. Target: every predicted step time within 5 % of the measured one. The
table goes in the README.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from primuspipe.calibration.accuracy import replay_accuracy  # noqa: E402
from primuspipe.calibration.measure import measure_runs as calibrate_runs  # noqa: E402
from primuspipe.calibration.runs import outliers  # noqa: E402
from primuspipe.errors import PrimusPipeError  # noqa: E402
from primuspipe.ir.cost_model import CostModel  # noqa: E402
from primuspipe.testing.host_memory import keep_freed_memory  # noqa: E402
from primuspipe.io.timeline import Timeline, idle_share  # noqa: E402
from primuspipe.tools.pp_vis import load_iterations  # noqa: E402
from write_results import markdown_table  # noqa: E402

CALIBRATION = "1f1b"
PREDICTED = ("zb-h1", "zbv", "interleaved-1f1b", "v-half")
TARGET = 0.05
REPLAY_ROLE = ("calibration replay: the 1F1B table with the split probe that these steps ran, simulated under the "
               "file calibrated from the same steps; not a prediction, so left out of max_abs_error")
_TICK = os.sysconf("SC_CLK_TCK")
HOST_MEMORY_HELP = ("make the ranks keep the memory they free (primuspipe/testing/host_memory.py), as a GPU's caching "
                    "allocator does; by default glibc hands it back to the kernel and a node that then needs more "
                    "memory faults its pages back in, a cost that follows each schedule's memory pattern (the split "
                    "probe's windows, ZB-H1's last rank)")


def _busy_seconds() -> float:
    """CPU seconds the whole host has spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / _TICK


def _own_seconds() -> float:
    """CPU seconds this bench and the processes it ran have used."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def wait_for_quiet(limit_s: float, below: float = 0.15) -> float:
    """Wait until the host's CPUs are busy less than ``below`` of one second; return the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        before = _busy_seconds()
        time.sleep(1.0)
        if (_busy_seconds() - before) / (os.cpu_count() or 1) < below:
            break
    return time.monotonic() - start


@contextlib.contextmanager
def held(lock: Path | None):
    """Hold ``lock`` (an flock file shared with other heavy jobs) while running, when one is given."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_session(pp: int, args: argparse.Namespace, dump_root: Path, rep: int) -> dict[str, dict]:
    """One gloo session of ``pp`` ranks (Megatron CPU harness) that trains every algorithm's model
    ``--iterations`` times, a step of each in turn (the order rotating every round), with dumps: all
    algorithms see the machine in the same state. Session ``rep`` builds the models in an order
    rotated ``rep`` places. Returns per algorithm its dump folder and what other processes took
    meanwhile."""
    from primuspipe.algorithms import get_algorithm
    from primuspipe.backends.megatron.config import PrimusPipeConfig
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.testing.megatron import compare
    from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo

    names = run_keys(pp, args)
    dumps = {name: dump_root / f"{name}-run{rep}" for name in names}

    def work(ctx) -> None:
        import gc

        import torch.distributed
        from megatron.core import parallel_state

        def layout(vpp: int) -> None:  # one process holds models of both vpp: say which one runs
            parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)

        runs = {}
        # the models are built in an order rotating every session: identical 1F1B models of one session
        # took steps up to 9 % apart (868-952 ms), and whatever part of that comes with a model's place
        # in memory must not stay with one algorithm through every session
        for key in rotated(names, rep):
            name, m = shape_of(key, args)
            info = get_algorithm(name)
            vpp = info.resolve_vpp(None)
            spec = compare.StepSpec(model(args), m, ddp=True, placement=info.placement)
            layout(vpp)
            probe = args.split_probe if key == CALIBRATION else 0  # 1F1B times B and W too (passes/split_probe.py)
            schedule = PrimusForwardBackward(PrimusPipeConfig(True, name, dump_pp_data=True, dump_dir=str(dumps[key]),
                                                              split_probe=probe))
            name = key
            runs[name] = (vpp, spec, compare.build(spec, pp, vpp)[2], schedule)
        gc.collect()  # as Megatron-LM's --manual-gc: a collection (100+ ms of CPU) never lands inside a step
        gc.disable()
        for step in range(args.iterations):
            gc.collect()
            for name in rotated(names, step):
                vpp, spec, built, schedule = runs[name]
                layout(vpp)
                for chunk in built:
                    chunk.zero_grad_buffer()
                torch.distributed.barrier()  # every step starts on all ranks together
                compare.call_schedule(schedule, spec, built)

    waited = wait_for_quiet(args.quiet_wait)
    with held(args.lock):
        busy, ours, start = _busy_seconds(), _own_seconds(), time.monotonic()
        run_on_gloo(work, ParallelLayout(pp, 2), timeout_s=3600)
        wall = time.monotonic() - start
        external = max(0.0, (_busy_seconds() - busy) - (_own_seconds() - ours)) / wall
    return {name: {"dump": str(dumps[name]), "external_cores": round(external, 3), "quiet_wait_s": round(waited, 1)}
            for name in names}


def run_keys(pp: int, args: argparse.Namespace) -> tuple[str, ...]:
    """What a session runs: the calibration, every predicted algorithm at ``--microbatches`` (the tuning
    shape), and 1F1B (without probe) and every predicted algorithm at each held-out count (``name@m<count>``)."""
    held_out = [m for m in held_out_counts(pp, args) if m != args.microbatches]
    return (CALIBRATION, *PREDICTED, *(f"{name}@m{m}" for m in held_out for name in (CALIBRATION, *PREDICTED)))


def held_out_counts(pp: int, args: argparse.Namespace) -> list[int]:
    """``--held-out`` multiples of pp, as microbatch counts."""
    return sorted({k * pp for k in args.held_out})


def shape_of(key: str, args: argparse.Namespace) -> tuple[str, int]:
    """``(algorithm, microbatches)`` of a run key (see :func:`run_keys`)."""
    name, _, m = key.partition("@m")
    return name, int(m) if m else args.microbatches


def rotated(names: tuple[str, ...], k: int) -> tuple[str, ...]:
    """``names`` starting at its ``k``-th (modulo its length): a different algorithm first each time."""
    k %= len(names)
    return names[k:] + names[:k]


def model(args: argparse.Namespace):
    """The GPT the runs train: tiny-gpt with the bench's sizes."""
    from primuspipe.testing.megatron import tiny_models

    return dataclasses.replace(tiny_models.TINY_MODELS["tiny-gpt"], hidden_size=args.hidden,
                               ffn_hidden_size=4 * args.hidden, num_attention_heads=4, seq_length=args.seq,
                               micro_batch_size=args.micro_batch_size, num_layers=args.layers, vocab_size=512)


def bubble_rate(timeline: Timeline) -> float:
    """The worst rank's ``(step - busy) / step`` (busy: compute time), as the simulator counts it."""
    step = timeline.step_time
    return max(idle_share(step, sum(e.end - e.start for e in rt.events if e.node.kind.is_compute))
               for rt in timeline.ranks)


def accepted_session(pp: int, args: argparse.Namespace, work: Path, rep: int) -> dict[str, dict]:
    """A session in which other processes took at most ``--max-external`` cores (the last try
    otherwise)."""
    tries = []
    for attempt in range(args.retries + 1):
        records = run_session(pp, args, work / f"pp{pp}" / f"try{attempt}", rep)
        tries.append(records[CALIBRATION]["external_cores"])
        if tries[-1] <= args.max_external:
            break
    for name, record in records.items():
        record["external_cores_tries"] = tries
        timelines = load_iterations(record["dump"])[1:]
        print(f"  pp={pp} {name:17s} run {rep}: step {statistics.median(t.step_time for t in timelines) * 1e3:7.2f} ms, "
              f"other processes {tries[-1]:.2f} cores", flush=True)
    return records


def predict(runs: list[list[Timeline]], pp: int, args: argparse.Namespace, folder: Path) -> tuple[dict, dict]:
    """Calibrate from 1F1B runs' iterations (several runs pooled as ``primuspipe calibrate`` pools dumps: a run
    whose step lies far outside the others' is left out, primuspipe/calibration/runs.py); simulate every
    algorithm with ``primuspipe simulate -a all`` at the tuning shape and at every held-out microbatch count
    (rows keyed as :func:`run_keys` names the runs)."""
    # steps start together here (a barrier before each) and a dump's consecutive iterations are not
    # consecutive steps (the other algorithms run in between): no gaps between steps to model
    measured = dataclasses.replace(calibrate_runs(runs, warmup=0), step_gap=None)
    timelines = [t for run in runs for t in run]
    folder.mkdir(parents=True, exist_ok=True)
    cost_file = folder / "measured_cost.yaml"
    cost_file.write_text(measured.to_yaml())
    own = replay_accuracy(timelines, CostModel.load(cost_file, pp=pp, vpp=1))
    # the same file without the fixed parts: each 1F1B stage's time cut evenly over its chunks (what a
    # backend that cannot time the layers gets), predicted beside it from the same runs
    even = measured.cost_dict()
    for key in ("fixed", "chunk"):
        even["compute"].pop(key, None)
    even_file = folder / "measured_cost_even_split.yaml"
    even_file.write_text(yaml.safe_dump(even, sort_keys=False))
    rows, even_rows = {}, {}
    for m in sorted({args.microbatches, *held_out_counts(pp, args)}):
        suffix = "" if m == args.microbatches else f"@m{m}"
        for into, file in ((rows, cost_file), (even_rows, even_file)):
            simulated = primuspipe("simulate", "-a", "all", "--pp", str(pp), "-m", str(m),
                                   "--cost", str(file), "--plan-cost", "unit", "--json")
            into.update((row["algorithm"] + suffix, row) for row in simulated["results"] if "error" not in row)
    for name, row in rows.items():
        row["even_split_step_time"] = even_rows[name]["step_time"]
    # the calibration steps ran 1F1B with the split probe, not the plain 1F1B `simulate -a all` times: their
    # row is the probed table that ran, replayed under the file those same steps calibrated (not a prediction)
    even_replay = replay_accuracy(timelines, CostModel.load(even_file, pp=pp, vpp=1))
    rows[CALIBRATION] = {"algorithm": CALIBRATION, "vpp": 1, "step_time": own.step_time.simulated,
                         "bubble_rate": own.bubble_rate.simulated,
                         "even_split_step_time": even_replay.step_time.simulated}
    calibration = {"cost_model": measured.cost_dict(), "notes": list(measured.notes),
                   "dropped_runs": list(measured.dropped_runs), "replay_of_the_1f1b_runs": own.to_dict()}
    return calibration, rows


def diagnose(iterations: list[Timeline], cost_file: Path, pp: int) -> dict:
    """Where a run's prediction error comes from. ``own_cost_error``: the run's node order replayed under a
    file calibrated from its own dump (per model stage; the simulator's error given exact node costs, which
    the calibration from 1F1B cannot beat); ``node_cost_errors``: per kind the run ran and model stage, what
    the 1F1B file charges the run's nodes of that kind over what the run's own file charges them, less 1
    (which node costs the 1F1B run mis-states; :func:`priced`)."""
    from primuspipe.calibration.replay import executed_table

    first = iterations[0]
    own = dataclasses.replace(calibrate_runs([iterations], warmup=0), step_gap=None)
    try:
        own_model = CostModel.from_dict(own.cost_dict(per_model_stage=True), pp=pp, vpp=first.vpp)
    except PrimusPipeError as exc:  # the run's own file is refused: say why instead of a figure
        return {"error": str(exc)}
    predicted = CostModel.load(cost_file, pp=pp, vpp=first.vpp)
    table = executed_table(first)
    theirs, ours = priced(predicted, table), priced(own_model, table)
    return {"own_cost_error": replay_accuracy(iterations, own_model).to_dict()["step_time"]["error"],
            "node_cost_errors": {key: [theirs[key, s] / ours[key, s] - 1 if ours.get((key, s)) else None
                                       for s in range(own_model.num_stages)]
                                 for key in sorted({key for key, _ in ours})}}


def priced(model: CostModel, table) -> dict[tuple[str, int], float]:
    """Per cost key and model stage, what ``model`` charges the table's single-part compute nodes in all,
    each as the simulator prices it: a W warm or cold by the node before it, a node that opens a window at its
    rank's share, a chunk's first of its kind with its cold start (a kind's plain time alone mis-states a
    run whose Ws all ran warm, ZB-H1's first rank's, by the cold-warm gap)."""
    from primuspipe.ir.row_context import window_openings

    out: dict[tuple[str, int], float] = {}
    for rank, row in enumerate(table.ranks):
        previous, seen = None, set()
        for node, window in zip(row, window_openings(row) if model.prices_windows else [False] * len(row)):
            if not node.kind.is_compute:
                continue
            if node.pair is None and (key := node.kind.spec.cost):
                stage = table.placement.stage(rank, node.chunk)
                cold = model.cold_start_time([(node.kind, stage)]) if (node.kind, node.chunk) not in seen else 0.0
                out[key, stage] = out.get((key, stage), 0.0) + model.node_time(table.placement, rank, node, previous,
                                                                                window) + cold
            seen.update((p.kind, p.chunk) for p in node.parts())
            previous = node
    return out


def check_ran_as_planned(key: str, pp: int, args: argparse.Namespace, ran: Timeline, dump: str) -> None:
    """The run's node order is the table ``build_schedule`` plans with unit costs (what the prediction
    simulates); the 1F1B calibration runs carry their split probe and are left out."""
    from primuspipe.algorithms.build import build_schedule
    from primuspipe.calibration.replay import executed_table

    name, m = shape_of(key, args)
    if executed_table(ran).ranks != build_schedule(name, pp, m).compute_only().ranks:
        raise RuntimeError(f"{name} at pp={pp} did not run the table the prediction simulates ({dump})")


def primuspipe(*argv: str) -> dict:
    """The ``primuspipe`` command a user runs, with ``--json`` output parsed."""
    done = subprocess.run([sys.executable, "-c", "import sys; from primuspipe.cli import main; sys.exit(main())", *argv],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"primuspipe {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def measure_runs(pp: int, args: argparse.Namespace, work: Path) -> dict[str, list[dict]]:
    """Every algorithm's runs at ``pp``, in turn, ``--runs`` times; kept in ``work`` for ``--reuse``."""
    saved = work / f"pp{pp}" / "runs.json"
    if args.reuse:
        return json.loads(saved.read_text())
    runs: dict[str, list[dict]] = {name: [] for name in run_keys(pp, args)}
    for rep in range(args.runs):
        for name, record in accepted_session(pp, args, work, rep).items():
            runs[name].append(record)
    saved.write_text(json.dumps(runs, indent=1))
    return runs


def compare(pp: int, runs: dict[str, list[dict]], args: argparse.Namespace, work: Path) -> dict:
    """Predicted vs measured step and bubble of every algorithm at ``pp``. Each session is calibrated
    from its own 1F1B runs and predicts the other algorithms of that session (they met the machine in
    the same state); the error is the median over sessions. ``pooled`` is the prediction of one file
    calibrated from every session's 1F1B runs, against the median step over sessions."""
    # each run's iterations but its first, read once
    kept = {name: [load_iterations(r["dump"])[1:] for r in records] for name, records in runs.items()}
    for name in runs:
        if name == CALIBRATION:
            continue
        for record, iterations in zip(runs[name], kept[name]):
            check_ran_as_planned(name, pp, args, iterations[-1], record["dump"])
    calibrations = kept[CALIBRATION]
    sessions = [predict([run], pp, args, work / f"pp{pp}" / f"session{i}") for i, run in enumerate(calibrations)]
    pooled_calibration, pooled = predict(calibrations, pp, args, work / f"pp{pp}")
    # a session whose 1F1B calibration step lies far outside the other sessions' met a slow (or free) moment
    # of the host: its prediction says nothing about the cost model, so the medians leave it out (the
    # pooled file leaves it out the same way); its errors stay in session_errors
    calibration_steps = [statistics.median(t.step_time for t in run) for run in calibrations]
    dropped = set(outliers(calibration_steps))
    if dropped:
        print(f"pp={pp}: session(s) {', '.join(map(str, sorted(dropped)))} left out of the medians: 1F1B calibration "
              f"step {', '.join(f'{calibration_steps[i] * 1e3:.1f}' for i in sorted(dropped))} ms against the sessions' "
              f"median {statistics.median(calibration_steps) * 1e3:.1f} ms (outside the robust band)", flush=True)
    table = []
    for name, records in runs.items():
        per_run = kept[name]
        steps = [statistics.median(t.step_time for t in run) for run in per_run]
        bubbles = [statistics.median(map(bubble_rate, run)) for run in per_run]
        predicted = [rows[name] for _, rows in sessions]
        errors = [p["step_time"] / step - 1 for p, step in zip(predicted, steps)]
        even_errors = [p["even_split_step_time"] / step - 1 for p, step in zip(predicted, steps)]
        step = statistics.median(steps)
        error = statistics.median(e for i, e in enumerate(errors) if i not in dropped)
        algorithm, m = shape_of(name, args)
        table.append({
            "algorithm": algorithm, "microbatches": m, "held_out": m != args.microbatches, "vpp": predicted[0]["vpp"],
            "role": REPLAY_ROLE if name == CALIBRATION else "prediction",
            "predicted_step_s": statistics.median(p["step_time"] for p in predicted), "measured_step_s": step,
            "error": error, "session_errors": errors,
            "predicted_bubble_rate": statistics.median(p["bubble_rate"] for p in predicted),
            "measured_bubble_rate": statistics.median(bubbles),
            "pooled": {"predicted_step_s": pooled[name]["step_time"], "error": pooled[name]["step_time"] / step - 1},
            "even_split": {"error": statistics.median(e for i, e in enumerate(even_errors) if i not in dropped),
                           "session_errors": even_errors},
            "measured_runs": [{"step_s": x, "bubble_rate": y, "predicted_step_s": p["step_time"], **{k: r[k] for k in (
                "external_cores", "external_cores_tries")}} for x, y, p, r in zip(steps, bubbles, predicted, records)],
            "diagnosis": [diagnose(run, work / f"pp{pp}" / f"session{i}" / "measured_cost.yaml", pp)
                          for i, run in enumerate(per_run)]})
        own_errors = [d["own_cost_error"] for d in table[-1]["diagnosis"] if "own_cost_error" in d] or [math.nan]
        print(f"pp={pp} {name:17s} measured {step * 1e3:7.2f} ms; per session predicted/measured - 1: "
              f"{', '.join(f'{e:+.1%}' for e in errors)} (median {error:+.1%}); pooled file "
              f"{table[-1]['pooled']['error']:+.1%}; replayed under its own costs {statistics.median(own_errors):+.1%}",
              flush=True)
    return {"calibration": [calibration for calibration, _ in sessions], "pooled_calibration": pooled_calibration,
            "calibration_step_s": calibration_steps, "sessions_left_out": sorted(dropped), "algorithms": table}


def markdown(report: dict) -> str:
    """The README's table: per pp and algorithm, predicted vs measured step (ms) and bubble rate."""
    rows = []
    for pp, entry in report["pp"].items():
        for row in entry["algorithms"]:
            runs = [r["step_s"] * 1e3 for r in row["measured_runs"]]
            errors = row["session_errors"]
            replay = row.get("role") == REPLAY_ROLE
            rows.append([pp, str(row.get("microbatches", report["microbatches"])),
                         row["algorithm"] + (" + probe (calibration replay)" if replay else ""),
                         str(row["vpp"]), f"{row['predicted_step_s'] * 1e3:.0f}",
                         f"{row['measured_step_s'] * 1e3:.0f} ({min(runs):.0f}-{max(runs):.0f})",
                         f"{row['error']:+.1%} ({min(errors):+.1%} to {max(errors):+.1%})",
                         f"{row['pooled']['error']:+.1%}",
                         f"{row['even_split']['error']:+.1%}" if "even_split" in row else "-"])
    return markdown_table(["pp", "m", "algorithm", "vpp", "predicted step (ms)", "measured step (ms): median (sessions)",
                           "error: median (sessions)", "error, one file from all sessions",
                           "error without compute.fixed (even split)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each algorithm per pp (median over them)")
    parser.add_argument("--iterations", type=int, default=8, help="training iterations per run (first dropped)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the GPT (ffn: 4x)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers (a multiple of 2 * pp)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--held-out", type=int, nargs="*", default=[],
                        help="also run the predicted algorithms at these multiples of pp microbatches (e.g. 1 4: m = pp "
                             "and 4pp), predicted from the same 1F1B calibration at --microbatches: shapes the cost "
                             "file was not measured at")
    parser.add_argument("--split-probe", type=int, default=2,
                        help="the 1F1B runs split the backward of 2N+1 middle microbatches per chunk into B and W (N "
                             "Ws right after their B, the others after the next B), so the calibration sees what "
                             "split-backward schedules pay for B and for warm and cold Ws (0: halve BW instead)")
    parser.add_argument("--lock", type=Path, help="an flock file held during each run (shared with other heavy jobs)")
    parser.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait for idle CPUs before a run")
    parser.add_argument("--max-external", type=float, default=0.25,
                        help="cores other processes may take during a run before it is done again")
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--keep-freed-memory", action="store_true", help=HOST_MEMORY_HELP)
    parser.add_argument("--keep", type=Path, help="keep the dumps and cost files here (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true",
                        help="run nothing: calibrate, predict and compare again from the runs kept in --keep")
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "bench" / "results" / "prediction.json")
    parser.add_argument("--markdown", type=Path, help="also write the table (README form) here")
    args = parser.parse_args()
    if args.reuse and args.keep is None:
        parser.error("--reuse needs --keep DIR, the folder of an earlier run")
    if bad := [pp for pp in args.pp if args.layers % (2 * pp)]:
        parser.error(f"--layers {args.layers} does not split into 2 x pp chunks at pp={bad[0]} (the vpp = 2 algorithms "
                     f"need a multiple of {2 * bad[0]}; e.g. --layers 12 for pp 2 and 3)")
    # the ranks are forked from this process and inherit its allocator's settings
    kept = args.keep_freed_memory and not args.reuse and keep_freed_memory()
    with contextlib.ExitStack() as stack:
        work = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="primuspipe-prediction-")))
        report: dict = {"bench": "prediction", "host": platform.node(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "microbatches": args.microbatches,
                        "iterations": args.iterations, "runs": args.runs, "model": dataclasses.asdict(model(args)),
                        "calibrated_from": CALIBRATION, "split_probe": args.split_probe, "held_out": args.held_out,
                        "target_relative_error": TARGET,
                        "host_memory": "freed memory kept" if kept else "glibc default" if not args.reuse else "reused runs",
                        "pp": {}}
        for pp in args.pp:
            report["pp"][str(pp)] = compare(pp, measure_runs(pp, args, work), args, work)
        errors = [abs(row["error"]) for entry in report["pp"].values() for row in entry["algorithms"]
                  if row["role"] != REPLAY_ROLE]
        report["max_abs_error"] = max(errors)
        report["meets_target"] = max(errors) <= TARGET
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
        table = markdown(report)
        if args.markdown:
            args.markdown.write_text(table)
        print(table)
        print(json.dumps({"max_abs_error": report["max_abs_error"], "meets_target": report["meets_target"]}))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
