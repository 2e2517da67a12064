"""The H100 file's attention figures against the cuDNN fused attention timed on a lent H100 80GB HBM3
(bench/results/gpu_kernels_h100.json, bench/bench_gpu_kernels.py): the model reproduces each measured forward and
backward, as an isolated kernel (sustained_fraction 1, as the bench models it)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from primuspipe.projection.compute import Work
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.published import EXAMPLES

RESULTS = EXAMPLES.parents[1] / "bench" / "results" / "gpu_kernels_h100.json"
LABEL = re.compile(r"cudnn_attention (\d+) x (\d+) heads x (\d+) x (\d+)$")


def _cudnn_rows() -> list[tuple[str, int, int, int, int, float]]:
    """(pass, batch, heads, head dim, length, measured seconds) of every cuDNN attention row."""
    rows = []
    for case in json.loads(RESULTS.read_text())["cases"]:
        match = LABEL.match(case["case"])
        if match and case["kind"].startswith("attention"):
            rows.append((case["kind"].split()[1], *map(int, match.groups()), case["measured_s"]))
    return rows


# Tolerances the H100 file states: head dim 128 is what its length tables are read from (to their 3 decimals);
# head dim 64 takes one rate for both passes, the geometric middle of the four measured ratios, each within 3.5 %.
TOLERANCE = {128: 0.005, 64: 0.036}


@pytest.mark.parametrize("row", _cudnn_rows(), ids=lambda r: f"{r[0]}-{r[1]}x{r[2]}x{r[3]}x{r[4]}")
def test_h100_attention_takes_cudnns_measured_time(row):
    pass_name, batch, heads, dim, length, measured = row
    h100 = dataclasses.replace(load_hardware(EXAMPLES / "hardware" / "h100.yaml"), sustained_fraction=1.0)
    flops = 4 * batch * heads * length * length * dim / 2 * (2.5 if pass_name == "backward" else 1.0)
    modelled = Work(attention_flops=flops).attention_seconds(h100, "bf16", length, dim, pass_name == "backward")
    assert modelled == pytest.approx(measured, rel=TOLERANCE[dim])


def test_every_measured_shape_is_held():
    """Both passes at every length the length tables are read from, and head dim 64 (a bench that stopped timing
    a shape would leave a table row unchecked)."""
    rows = _cudnn_rows()
    assert {(r[0], r[4]) for r in rows if r[3] == 128} == {(p, n) for p in ("forward", "backward")
                                                            for n in (1024, 2048, 4096, 8192, 16384)}
    assert {(r[0], r[4]) for r in rows if r[3] == 64} == {(p, n) for p in ("forward", "backward") for n in (4096, 8192)}
