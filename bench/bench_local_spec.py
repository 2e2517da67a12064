"""The projection of megatron-core's local spec against the runs it describes, measured on a lent H100.

    PYTHONPATH=. python bench/bench_local_spec.py [--output bench/results/local_spec_h100.json]

Three shapes, each run by ``examples/train_gpt.py`` on one GPU (pp 1, 8 microbatches, bf16, Adam, the local spec
with its fusions off and the softmax in fp32) under 1F1B and ZB-H1, and described to ``primuspipe project`` by
Megatron-LM's own argument list on ``examples/projection/hardware/h100.yaml``, analytically (no GPU needed):

* ``base`` (``bench/gpu_suite.sh`` part 5; ``bench/data/single_gpu_h100_args.txt``): 4 layers of hidden 2048, 16
  heads, sequence 2048, MBS 4, a 64-token vocabulary; measured in ``bench/results/gpu_single_h100.json``
  (``after_fixes``);
* ``a`` and ``b`` (part 9; ``bench/data/local_shape_{a,b}_args.txt``; ``bench/results/gpu_local_shapes_h100.json``),
  which nothing was fitted on: 6 layers of hidden 1024, 8 heads, sequence 4096, MBS 2, an untied 32,000 vocabulary;
  8 layers of hidden 3072, 24 heads, sequence 1024, MBS 8, a tied 50,304 vocabulary, no biases.

Measured: each algorithm's median step time and its steady peak allocated memory (``torch.cuda.max_memory_allocated``,
the median over its iterations after the first, whose optimizer state does not exist yet), against the projected
peak less the runtime reserve the projection adds for the CUDA context and allocator caching (which
``max_memory_allocated`` does not see).
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
HARDWARE = ROOT / "examples/projection/hardware/h100.yaml"
ARGS = {"base": ROOT / "bench/data/single_gpu_h100_args.txt", "a": ROOT / "bench/data/local_shape_a_args.txt",
        "b": ROOT / "bench/data/local_shape_b_args.txt"}
BASE = ROOT / "bench/results/gpu_single_h100.json"
SHAPES = ROOT / "bench/results/gpu_local_shapes_h100.json"
PEAK = re.compile(r"peak GB ([0-9.]+)")


def measured() -> dict[tuple[str, str], dict[str, float]]:
    """Median step time and steady peak allocated bytes per (shape, algorithm) of the lent H100's runs."""
    run = json.loads(BASE.read_text())["after_fixes"]
    lines = run["per_iteration"]  # 1F1B's iterations, then ZB-H1's, one line each
    half = len(lines) // 2
    peaks = {"1f1b": lines[:half], "zb-h1": lines[half:]}
    steps = {"1f1b": run["train_1f1b"]["step_time_s"], "zb-h1": run["train_zb_h1"]["step_time_s"]}
    out = {("base", name): {"step_time_s": steps[name],
                            "peak_allocated_bytes": 1e9 * statistics.median(float(PEAK.search(x)[1]) for x in mine[1:])}
           for name, mine in peaks.items()}
    for row in json.loads(SHAPES.read_text())["runs"]:  # "run": shape_<shape>_<algorithm>
        _, shape, algorithm = row["run"].split("_", 2)
        out[shape, algorithm] = {"step_time_s": row["step_time_s"], "peak_allocated_bytes": row["steady_peak_bytes"]}
    return out


def projected(shape: str, algorithm: str) -> dict[str, float]:
    config = read_megatron_config(ARGS[shape])
    result = Projector(config.model, load_hardware(HARDWARE)).evaluate(config.training, algorithm)
    allocated = result.peak_memory_bytes[0] - result.memory_breakdown["runtime_reserved"]
    return {"step_time_s": result.step_time_s, "peak_allocated_bytes": allocated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench/results/local_spec_h100.json")
    out = parser.parse_args().output
    rows = []
    for (shape, algorithm), seen in measured().items():
        model = projected(shape, algorithm)
        rows.append({"shape": shape, "arguments": str(ARGS[shape].relative_to(ROOT)), "algorithm": algorithm,
                     "measured": seen, "projected": model, "error": {k: model[k] / seen[k] - 1 for k in seen}})
        print(f"{shape} {algorithm}: step {model['step_time_s']:.4f} s projected / {seen['step_time_s']:.4f} s "
              f"measured ({rows[-1]['error']['step_time_s']:+.1%}); peak allocated {model['peak_allocated_bytes'] / 1e9:.2f} GB"
              f" / {seen['peak_allocated_bytes'] / 1e9:.2f} GB ({rows[-1]['error']['peak_allocated_bytes']:+.1%})")
    Path(out).write_text(json.dumps({"command": "PYTHONPATH=. python bench/bench_local_spec.py",
                                     "hardware": str(HARDWARE.relative_to(ROOT)), "rows": rows}, indent=1) + "\n")

if __name__ == "__main__":
    main()
