"""The emulator against what real NCCL did on a GPU: the verdicts NCCL gave every time it ran a pattern.

``bench/results/nccl_one_gpu_h100.json`` holds real NCCL 2.28.9 on a lent H100 (ranks sharing the GPU as
distinct NCCL hosts, ``bench/nccl_one_gpu.py``): each communication pattern under lazy communicator init
(torch's default, the emulator's ``pair``) and eager init (``group``), repeated for some. Where NCCL gave one
verdict in every run at the large message size (64 MiB: no transport buffering can complete a send alone),
the emulator, run on CPU with the very same worker, must give that verdict too. Verdicts that differed
between NCCL runs (the lazy-init isend ring) and small messages (which NCCL's transport may buffer) are not
held (docs/design.md §3 says why).
"""

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "nccl_one_gpu_h100.json"
EMULATED = {"nccl-lazy": "pair", "nccl-eager": "group"}


def unanimous_verdicts() -> dict[tuple[str, str], str]:
    """(pattern, emulator mode) -> NCCL's verdict, for the large-message patterns NCCL judged alike every run."""
    data = json.loads(RESULTS.read_text())
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    for rows in [data["rows"], *data.get("reruns", {}).values()]:
        for row in rows:
            if row["size"] != "large":
                continue
            for real, mode in EMULATED.items():
                if real in row and row[real]["outcome"] in ("ok", "hang"):
                    seen[row["pattern"], mode].add(row[real]["outcome"])
    return {key: outcomes.pop() for key, outcomes in seen.items() if len(outcomes) == 1}


def test_the_gpu_record_holds_both_verdicts_and_both_modes():
    verdicts = unanimous_verdicts()
    assert set(verdicts.values()) == {"ok", "hang"} and {mode for _, mode in verdicts} == {"pair", "group"}


@pytest.mark.slow
def test_the_emulator_gives_the_verdicts_real_nccl_gave(tmp_path):
    verdicts = unanimous_verdicts()
    patterns = sorted({pattern for pattern, _ in verdicts})
    out = tmp_path / "emulated.json"
    # only the large size is held, and every launch at once: a hang costs the deadline once, not once a wave
    subprocess.run([sys.executable, "bench/nccl_one_gpu.py", "patterns", "--modes", "pair", "group", "--patterns",
                    *patterns, "--sizes", "large", "--deadline", "8", "--parallel", str(2 * len(patterns)), "-o",
                    str(out)], cwd=ROOT, check=True, capture_output=True, text=True, timeout=400)
    emulated = {(row["pattern"], mode): row[mode]["outcome"] for row in json.loads(out.read_text())["rows"]
                if row["size"] == "large" for mode in ("pair", "group")}
    disagree = {key: (nccl, emulated[key]) for key, nccl in verdicts.items() if emulated[key] != nccl}
    assert not disagree, f"(pattern, mode): (NCCL's verdict, the emulator's): {disagree}"
