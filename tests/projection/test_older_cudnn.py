"""The GB200 and GB300 files' older-cuDNN attention kernels (``attention_kernels``: cudnn-9.13, cudnn-9.10) against the
cuDNN releases NVIDIA timed (examples/projection/hardware/measurements/attention.yaml, ``releases`` and
``older_kernels``): each entry is its base release's rates times the same-GPU ratios between releases, at every
published length, and every GB200 / GB300 row on a 2025 container older than NGC 25.11 names the kernel of its time."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from primuspipe.projection.compute import Work
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.published import EXAMPLES
from published_rows import shipped_runs

MEASUREMENTS = EXAMPLES / "hardware" / "measurements" / "attention.yaml"
DOCUMENT = yaml.safe_load(MEASUREMENTS.read_text())
RELEASES = {(r["gpu"], r["kernel"]): {p[0]: p[1:] for p in r["points"]} for r in DOCUMENT["releases"]}
BATCH, HEADS, HEAD_DIM = 1, 128, 128  # the releases' benchmark shape


def _expected(entry: dict, length: int, backward: bool) -> float:
    """The entry's published TFLOP/s at ``length``: its base release's, times older over newer for each ratio."""
    rate = RELEASES[tuple(entry["base"])][length][backward]
    for newer, older in entry["ratios"]:
        rate *= RELEASES[tuple(older)][length][backward] / RELEASES[tuple(newer)][length][backward]
    return rate


def _cases() -> list[tuple[dict, int, bool]]:
    """(entry, tokens a sequence, backward) for every older kernel at every length of its base release."""
    return [(entry, length, backward) for entry in DOCUMENT["older_kernels"]
            for length in RELEASES[tuple(entry["base"])] for backward in (False, True)]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]['hardware']}-{c[0]['attention_kernel']}-"
                                                      f"{'backward' if c[2] else 'forward'}-{c[1]}")
def test_each_older_kernel_is_its_base_release_times_the_release_ratios(case):
    """An isolated kernel (sustained fraction 1) of the benchmark's shape runs at the derived rate, within the 0.2 %
    the tables' three decimals leave (the GB200's cudnn-9.10 8k forward: 1,584 x 1,716 / 1,899 x 1,248 / 1,384 =
    1,291 TFLOP/s, 0.527 of 2,450)."""
    entry, length, backward = case
    hardware = load_hardware((MEASUREMENTS.parent / entry["hardware"]).resolve())
    kernel = hardware.with_attention_kernel(entry["attention_kernel"], "test")
    isolated = dataclasses.replace(kernel, sustained_fraction=1.0)
    flops = 4 * BATCH * HEADS * length * length * HEAD_DIM / 2 * (2.5 if backward else 1.0)
    seconds = Work(attention_flops=flops).attention_seconds(isolated, "bf16", length, HEAD_DIM, backward)
    assert flops / seconds / 1e12 == pytest.approx(_expected(entry, length, backward), rel=0.002)


@pytest.mark.parametrize("entry", DOCUMENT["older_kernels"], ids=lambda e: f"{e['hardware']}-{e['attention_kernel']}")
def test_an_older_kernel_is_slower_than_the_files_own_at_every_published_length(entry):
    """Going back a release never gains: each entry runs below the file's own rates (cuDNN 9.17 on the GB200, 9.22 on
    the GB300) at every length of its tables, both passes, and its tables give exactly the published lengths."""
    hardware = load_hardware((MEASUREMENTS.parent / entry["hardware"]).resolve())
    kernel = hardware.with_attention_kernel(entry["attention_kernel"], "test")
    lengths = set(RELEASES[tuple(entry["base"])])
    assert {n for n, _ in kernel.attention_length_rates} == lengths
    assert {n for n, _ in kernel.attention_backward_length_rates} == lengths
    for length in lengths:
        for backward in (False, True):
            older = kernel.attention_fraction * kernel.attention_rate(length, HEAD_DIM, backward)
            own = hardware.attention_fraction * hardware.attention_rate(length, HEAD_DIM, backward)
            assert older < own


def test_the_gb200_base_release_is_the_gb200_files_own_set():
    """The GB200's cuDNN 9.17.0 points the entries start from are the ones gb200.yaml's own rates are read from."""
    own = next(s for s in DOCUMENT["sets"] if s["hardware"] == "../gb200.yaml")
    assert RELEASES[("NVIDIA GB200", "cuDNN 9.17.0")] == {p[0]: p[1:] for p in own["points"]}


def _container_kernel(source: str) -> str | None:
    """The older kernel a row's container calls for: NGC 25.09 ran cuDNN 9.13 (cudnn-frontend's nv25.09 sample
    runs); a container of 25.04 held no cuDNN newer than NGC 25.06's 9.10.2; 25.11 and later run the files' own."""
    if "25.09" in source:
        return "cudnn-9.13"
    return "cudnn-9.10" if "25.04" in source else None


def test_every_blackwell_nvl72_row_on_an_older_container_names_its_kernel():
    """A GB200 / GB300 row whose source names a 25.04 or 25.09 container is timed at that era's cuDNN, not at the
    newer release the file's own rates were measured with (the Lambda GB300 run's directory says ngc25.04 but its
    log says PyTorch Release 25.09: the later wins)."""
    rows = [run for run in shipped_runs() if run.hardware in ("gb200", "gb300")]
    named = {run.id: run.training.get("attention_kernel") for run in rows}
    expected = {run.id: _container_kernel(run.source) for run in rows}
    assert named == expected
    assert sum(kernel is not None for kernel in expected.values()) == 29
