"""Which nodes pay page faults on CPU? Per node, the minor page faults of the rank's thread, glibc's default
allocator against one that keeps freed memory (primuspipe/testing/host_memory.py).

    python bench/node_page_faults.py [--sessions 1] [--iterations 6] [--hidden 128] [--layers 12] [--lock FILE] [-o OUT.json]

Runs bench_prediction.py's sessions at pp = 2, m = 8 (tiny GPT widened as there) with 1F1B carrying the split
probe and ZB-H1, each step's nodes wrapped to read ``RUSAGE_THREAD``'s minor faults at their start and end,
first as the C library's defaults leave it (a child process started with no ``MALLOC_`` variables), then
with ``KEEP_FREED_ENV``. Prints per algorithm, rank and node the median faults over the steps after the
first; writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from primuspipe.testing.host_memory import KEEP_FREED_ENV  # noqa: E402


def counting_session(out: Path, sessions: int, iterations: int, hidden: int, layers: int) -> None:
    """In this process: the sessions, with every compute node's faults appended to ``out/<algorithm>-r<rank>.jsonl``
    (one line per step: ``[[node, faults], ...]``)."""
    import resource

    import bench_prediction as bp
    from primuspipe.runtime import recorder

    class Counted(recorder.Stamp):
        __slots__ = ("faults",)

    clock, record, timeline = recorder.StepRecorder.clock, recorder.StepRecorder.record, recorder.StepRecorder.timeline

    def counted_clock(self):
        stamp = clock(self)
        if self.cuda:
            return stamp
        counted = Counted(float(stamp))
        counted.cpu, counted.faults = stamp.cpu, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        return counted

    def counted_record(self, node, start, end, tensor=None):
        if node.kind.is_compute and isinstance(start, Counted):
            self.__dict__.setdefault("faults", []).append((str(node), end.faults - start.faults))
        return record(self, node, start, end, tensor)

    def counted_timeline(self, table, rank, iteration):
        with open(out / f"{table.algorithm}-r{rank}.jsonl", "a") as f:
            f.write(json.dumps(self.__dict__.get("faults", [])) + "\n")
        return timeline(self, table, rank, iteration)

    recorder.StepRecorder.clock, recorder.StepRecorder.record = counted_clock, counted_record
    recorder.StepRecorder.timeline = counted_timeline
    bp.PREDICTED = ("zb-h1",)
    args = argparse.Namespace(runs=1, iterations=iterations, microbatches=8, hidden=hidden, seq=64, layers=layers,
                              micro_batch_size=4, held_out=[], split_probe=2, lock=None, quiet_wait=10.0,
                              max_external=0.25, retries=0)
    for rep in range(sessions):
        bp.run_session(2, args, out / "dumps", rep)


def medians(folder: Path, iterations: int) -> dict[str, dict[str, float]]:
    """Per ``<algorithm>-r<rank>``, each node's median faults over the steps of every session but each one's
    first (a session writes ``iterations`` lines)."""
    out = {}
    for path in sorted(folder.glob("*.jsonl")):
        steps = [json.loads(line) for line in path.read_text().splitlines()]
        per_node: dict[str, list[int]] = defaultdict(list)
        for step in (s for i, s in enumerate(steps) if i % iterations):
            for node, faults in step:
                per_node[node].append(faults)
        out[path.stem] = {node: statistics.median(v) for node, v in per_node.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the GPT (ffn: 4x)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--lock", type=Path, help="an flock file held while the ranks run")
    parser.add_argument("--keep", type=Path, help="keep the dumps and fault counts here, a folder per setting")
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "bench" / "results" / "node_page_faults.json")
    parser.add_argument("--count-into", type=Path, help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args()
    if args.count_into:
        counting_session(args.count_into, args.sessions, args.iterations, args.hidden, args.layers)
        return
    report: dict = {"hidden": args.hidden, "layers": args.layers}
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    for label, env in (("glibc default", base), ("freed memory kept", {**base, **KEEP_FREED_ENV})):
        with tempfile.TemporaryDirectory(prefix="primuspipe-faults-") as temporary:
            work = args.keep / label.replace(" ", "-") if args.keep else Path(temporary)
            work.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, __file__, "--count-into", str(work), "--sessions", str(args.sessions),
                       "--iterations", str(args.iterations), "--hidden", str(args.hidden), "--layers", str(args.layers)]
            if args.lock:
                command = ["flock", str(args.lock), *command]
            subprocess.run(command, check=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            report[label] = medians(work, args.iterations)
        print(label)
        for row, nodes in report[label].items():
            print(f"  {row}: " + " ".join(f"{n}:{v:.0f}" for n, v in nodes.items()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
