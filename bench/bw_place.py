"""Where a fused backward runs in plain 1F1B changes what it costs: do the probe's fused samples see the mix?

    python bench/bw_place.py DUMPS... [--count 2] [--fused 1,7 ...] [-o bench/results/bw_place.json]

Reads the dump folders ``bench/bench_auto_replan.py --keep DIR`` keeps (``DIR/pp<N>-run<k>/iter_*/rank_*.json``)
and their plain 1F1B steps: the steps after the decision (iteration ``--warmup + --measure`` on) of runs that
stayed on 1F1B. Calibration times ``compute.bw`` from the BWs the split probe leaves fused, less each chunk's
first (its cold start, timed apart), so per pp and rank, on the thread CPU clock:

* **place**: the median CPU time of the steady-state BWs (right after a forward) and the cool-down ones (right
  after another backward; rank ``r`` of ``pp``: the last ``pp - 1 - r`` microbatches), over all of them and over
  those during which at most one other rank ran a compute node (equal crowding);
* **samples**: per step, the mean of the BWs a probe leaves fused over the mean of every BW but the first (what
  plain 1F1B runs and the simulator charges one ``compute.bw`` for); median over steps. The default set is the
  current probe's (:func:`~primuspipe.passes.split_probe.probed_microbatches` with ``--count``); ``--fused``
  adds others (e.g. ``1,7``: the BWs a probe that split microbatches 2-6 of eight would leave);
* **calibrated**: per run that stayed on 1F1B, each stage's ``compute.bw`` and ``compute.f`` calibrated from the
  probed steps (what the decision used) over the same calibrated from the run's plain steps, and plain 1F1B's
  step simulated under the first over the same under the second (both CPU-time calibrations of one run, so
  less moved by other jobs than the run's measured step); and that ``compute.bw`` ratio cut in two at the first
  plain step (the one right after the probed ones): probed over first plain (what the probe's place and the
  probe itself change) times first plain over the later plain steps (how the plain steps' BW moved on as the run
  went on), with each plain step's span over the first's;
* **by iteration**: per pp, each dumped iteration's BWs (all but the first of a step, fused ones only in a probed
  step) over the median of their run and rank, mean and share above 1.2: whether BW's cost drifts with the step
  index rather than with the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from primuspipe.algorithms.build import build_schedule  # noqa: E402
from primuspipe.calibration.measure import measure_costs  # noqa: E402
from primuspipe.calibration.replan import ReplanSettings  # noqa: E402
from primuspipe.calibration.replan_decision import decide  # noqa: E402
from primuspipe.io.run_dumps import merge_rank_dumps  # noqa: E402
from primuspipe.io.timeline import dump_iterations  # noqa: E402
from primuspipe.passes.split_probe import probed_microbatches  # noqa: E402

COMPUTE = re.compile(r"^(F|BW|B|W)(\d+)\.0$")


def dumped_steps(dumps: list[Path]):
    """``(run, iteration, pp, microbatches, ranks)`` per dumped vpp = 1 step: ``ranks`` is per rank ``[(kind,
    microbatch, start, end, cpu)]`` of its compute nodes in order, on the wall clock (``t0_unix`` + offsets) and the
    thread CPU clock."""
    for dump in dumps:
        for run in sorted(dump.glob("pp*-run*")):
            for step in sorted(run.glob("iter_*")):
                ranks, shape = [], None
                for path in sorted(step.glob("rank_*.json")):
                    data = json.loads(path.read_text())
                    (rank,) = data["ranks"]
                    t0, shape = data["meta"]["t0_unix"], (data["pp"], data["microbatches"], data["vpp"])
                    ranks.append([(m.group(1), int(m.group(2)), t0 + e["start"], t0 + e["end"],
                                   e["cpu"][1] - e["cpu"][0])
                                  for e in rank["events"] if (m := COMPUTE.match(e["node"]))])
                if shape and shape[2] == 1:
                    yield run, int(step.name.removeprefix("iter_")), shape[0], shape[1], ranks


def plain_steps(dumps: list[Path], first_plain: int):
    """``(pp, microbatches, ranks)`` per plain 1F1B step (:func:`dumped_steps`) from iteration ``first_plain`` on."""
    for _, iteration, pp, m, ranks in dumped_steps(dumps):
        if iteration >= first_plain and all(kind in ("F", "BW") for nodes in ranks for kind, *_ in nodes):
            yield pp, m, ranks


def by_iteration(dumps: list[Path]) -> list[dict]:
    """Per pp and iteration, the BWs but each step's first over the median of their run and rank: mean and the
    share above 1.2 (the steps' spikes)."""
    steps = list(dumped_steps(dumps))
    level: dict[tuple, list[float]] = defaultdict(list)
    for run, _, _, _, ranks in steps:
        for rank, nodes in enumerate(ranks):
            level[(run, rank)] += [cpu for kind, mb, *_, cpu in nodes if kind == "BW" and mb > 0]
    middle = {key: statistics.median(v) for key, v in level.items() if v}
    ratios: dict[tuple, list[float]] = defaultdict(list)
    for run, iteration, pp, _, ranks in steps:
        for rank, nodes in enumerate(ranks):
            ratios[(pp, iteration)] += [cpu / middle[(run, rank)] for kind, mb, *_, cpu in nodes if kind == "BW" and mb > 0]
    return [{"pp": pp, "iteration": iteration, "bw_over_median": round(statistics.fmean(v), 3),
             "share_above_1.2": round(sum(x > 1.2 for x in v) / len(v), 3), "n": len(v)}
            for (pp, iteration), v in sorted(ratios.items()) if v]


def calibrated(dumps: list[Path], warmup: int, measure: int) -> list[dict]:
    """Per kept run that stayed on 1F1B: the probed steps' calibration against the plain steps' own."""
    out = []
    for dump in dumps:
        for run in sorted(dump.glob("pp*-run*")):
            (decision,) = json.loads((run / "replan.json").read_text())
            if decision["switch"]:
                continue
            steps = {i: merge_rank_dumps(run, i) for i in dump_iterations(run)}
            probed = [t for i, t in steps.items() if warmup <= i < warmup + measure]
            plain = [t for i, t in steps.items() if i >= warmup + measure]
            first = plain[0]
            running = build_schedule("1f1b", pp=first.pp, microbatches=first.microbatches)
            settings = ReplanSettings(enabled=True)
            a, b, early, later = (measure_costs(steps_, warmup=0) for steps_ in (probed, plain, plain[:1], plain[1:]))
            predicted, own = (decide(steps_, running, settings).running_step_time for steps_ in (probed, plain))

            def bw(x, y) -> list[float]:
                return [round(p / q, 3) for p, q in zip(x.fused_backward, y.fused_backward)]

            out.append({"run": f"{dump.name}/{run.name}", "pp": first.pp, "bw_probed_over_plain": bw(a, b),
                        "f_probed_over_plain": [round(x / y, 3) for x, y in zip(a.forward, b.forward)],
                        "replay_probed_over_plain": round(predicted / own - 1, 4),
                        "cores_probed_plain": [a.cores, b.cores], "bw_probed_over_first_plain": bw(a, early),
                        "bw_first_plain_over_later": bw(early, later),
                        "step_over_first_plain": [round(t.step_time / first.step_time, 3) for t in plain]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dumps", type=Path, nargs="+", help="folders bench_auto_replan.py --keep wrote")
    parser.add_argument("--count", type=int, default=2, help="the probe's count (auto_replan's probe)")
    parser.add_argument("--fused", action="append", default=[], help="another set of fused microbatches, e.g. 6,7")
    parser.add_argument("--warmup", type=int, default=2, help="the runs' auto_replan_warmup")
    parser.add_argument("--measure", type=int, default=3, help="the runs' auto_replan_steps (the probed steps)")
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    place: dict[tuple, list[float]] = defaultdict(list)
    samples: dict[tuple, list[float]] = defaultdict(list)
    steps = 0
    for pp, m, ranks in plain_steps(args.dumps, args.warmup + args.measure):
        steps += 1
        deferred, at_once = probed_microbatches(m, args.count)
        sets = {"probe": tuple(k for k in range(m) if k not in deferred and k not in at_once),
                **{text: tuple(int(k) for k in text.split(",")) for text in args.fused}}
        for rank, nodes in enumerate(ranks):
            bw, previous = {}, None
            for kind, mb, start, end, cpu in nodes:
                if kind == "BW":
                    bw[mb] = cpu
                    if mb > 0:
                        where = "cool-down" if previous == "BW" else "steady"
                        middle = (start + end) / 2
                        busy = sum(any(s <= middle <= e for _, _, s, e, _ in other)
                                   for r, other in enumerate(ranks) if r != rank)
                        place[(pp, rank, where, "all")].append(cpu)
                        if busy <= 1:
                            place[(pp, rank, where, "at most one other rank busy")].append(cpu)
                previous = kind
            every = statistics.fmean(bw[k] for k in range(1, m))
            for name, fused in sets.items():
                if kept := [bw[k] for k in fused if k > 0]:
                    samples[(pp, rank, f"{name} {','.join(map(str, fused))}")].append(statistics.fmean(kept) / every)
    report = {"bench": "bw_place", "dumps": [str(d) for d in args.dumps], "plain_steps": steps, "count": args.count,
              "place_ms": [{"pp": pp, "rank": rank, "where": where, "crowding": crowd,
                            "median_cpu_ms": round(statistics.median(v) * 1e3, 2), "n": len(v)}
                           for (pp, rank, where, crowd), v in sorted(place.items())],
              "samples_over_plain": [{"pp": pp, "rank": rank, "fused": name, "median": round(statistics.median(v), 3),
                                      "n": len(v)} for (pp, rank, name), v in sorted(samples.items())]}
    report["calibrated"] = calibrated(args.dumps, args.warmup, args.measure)
    report["by_iteration"] = by_iteration(args.dumps)
    for row in report["place_ms"]:
        print(f"pp={row['pp']} rank {row['rank']} {row['where']:>9} ({row['crowding']}): {row['median_cpu_ms']} ms "
              f"(n={row['n']})")
    for row in report["samples_over_plain"]:
        print(f"pp={row['pp']} rank {row['rank']} fused {row['fused']}: {row['median']:.3f} of the step's BWs "
              f"(n={row['n']})")
    for row in report["calibrated"]:
        print(f"{row['run']}: compute.bw probed / plain {row['bw_probed_over_plain']}, compute.f "
              f"{row['f_probed_over_plain']}; plain 1F1B replayed {row['replay_probed_over_plain']:+.1%}; compute.bw "
              f"probed / first plain {row['bw_probed_over_first_plain']}, first plain / later "
              f"{row['bw_first_plain_over_later']}; plain steps / the first {row['step_over_first_plain']}")
    for row in report["by_iteration"]:
        print(f"pp={row['pp']} iteration {row['iteration']}: BW {row['bw_over_median']:.3f} of its run and rank's "
              f"median, {row['share_above_1.2']:.0%} above 1.2 (n={row['n']})")
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
