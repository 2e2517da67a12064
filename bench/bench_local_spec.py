"""The projection of megatron-core's local spec against the run it describes, measured on a lent H100.

    PYTHONPATH=. python bench/bench_local_spec.py [--output bench/results/local_spec_h100.json]

The run (``bench/gpu_suite.sh`` part 5: ``examples/train_gpt.py`` on one GPU, 4 layers of hidden 2048, 16 heads,
sequence 2048, MBS 4, 8 microbatches, the local spec with its fusions off and the softmax in fp32) is described to
``primuspipe project`` by Megatron-LM's own argument list (``bench/data/single_gpu_h100_args.txt``) on
``examples/projection/hardware/h100.yaml``, analytically (no GPU needed), for 1F1B and ZB-H1. The measured side
is ``bench/results/gpu_single_h100.json`` (``after_fixes``): each algorithm's median step time, and its steady
peak allocated memory (``torch.cuda.max_memory_allocated``, the median over its iterations after the first,
whose optimizer state does not exist yet), against the projected peak less the runtime reserve the projection adds
for the CUDA context and allocator caching (which ``max_memory_allocated`` does not see).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import read_megatron_config
from primuspipe.projection.projection import Projector

ROOT = Path(__file__).resolve().parent.parent
ARGS = ROOT / "bench/data/single_gpu_h100_args.txt"
HARDWARE = ROOT / "examples/projection/hardware/h100.yaml"
MEASURED = ROOT / "bench/results/gpu_single_h100.json"
PEAK = re.compile(r"peak GB ([0-9.]+)")


def measured() -> dict[str, dict[str, float]]:
    """Median step time and steady peak allocated bytes per algorithm of the lent H100's run."""
    run = json.loads(MEASURED.read_text())["after_fixes"]
    lines = run["per_iteration"]  # 1F1B's iterations, then ZB-H1's, one line each
    half = len(lines) // 2
    peaks = {"1f1b": lines[:half], "zb-h1": lines[half:]}
    steps = {"1f1b": run["train_1f1b"]["step_time_s"], "zb-h1": run["train_zb_h1"]["step_time_s"]}
    return {name: {"step_time_s": steps[name],
                   "peak_allocated_bytes": 1e9 * statistics.median(float(PEAK.search(x)[1]) for x in lines[1:])}
            for name, lines in peaks.items()}


def projected(algorithm: str) -> dict[str, float]:
    config = read_megatron_config(ARGS)
    result = Projector(config.model, load_hardware(HARDWARE)).evaluate(config.training, algorithm)
    allocated = result.peak_memory_bytes[0] - result.memory_breakdown["runtime_reserved"]
    return {"step_time_s": result.step_time_s, "peak_allocated_bytes": allocated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench/results/local_spec_h100.json")
    out = parser.parse_args().output
    rows = []
    for algorithm, seen in measured().items():
        model = projected(algorithm)
        rows.append({"algorithm": algorithm, "measured": seen, "projected": model,
                     "error": {k: model[k] / seen[k] - 1 for k in seen}})
        print(f"{algorithm}: step {model['step_time_s']:.4f} s projected / {seen['step_time_s']:.4f} s measured "
              f"({rows[-1]['error']['step_time_s']:+.1%}); peak allocated {model['peak_allocated_bytes'] / 1e9:.2f} GB"
              f" / {seen['peak_allocated_bytes'] / 1e9:.2f} GB ({rows[-1]['error']['peak_allocated_bytes']:+.1%})")
    Path(out).write_text(json.dumps({"command": "PYTHONPATH=. python bench/bench_local_spec.py", "arguments": str(
        ARGS.relative_to(ROOT)), "hardware": str(HARDWARE.relative_to(ROOT)), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
