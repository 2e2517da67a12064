"""The GEMM efficiency curve by shape: its value at hand-computed shapes, monotone in size, off without the
hardware field (old files), and fitted to the shipped published measurements within the stated error."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from primuspipe.projection.gemm import Gemm, gemm_seconds, library_tile, shape_fraction
from primuspipe.projection.gemm_fit import MEASUREMENTS, MeasuredGemms, by_hardware_file, fit, load_measurements
from primuspipe.projection.hardware_spec import HardwareSpec, load_hardware
from primuspipe.projection.spec_fields import InputError

HW = HardwareSpec(name="t", peak_bf16_tflops=100.0, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=1e15,
                  intra_node_bandwidth_bytes_per_s=100e9, inter_node_bandwidth_bytes_per_s=10e9, gemm_efficiency=0.5,
                  compute_units=4, gemm_tile=(128, 128), peak_fp8_tflops=200.0, fp8_gemm_efficiency=0.25,
                  gemm_half_intensity=100.0)
UNIT = 2 * 128 * 128 / (100e12 * 0.5)  # seconds of one tile per unit of k at the flat bf16 rate


@pytest.mark.parametrize("m, n, k, fraction", [
    (300, 300, 300, 0.5),        # I = 300^3 / (3 * 300^2) = 100 = the half intensity
    (600, 600, 600, 2 / 3),      # I = 200
    (1200, 1200, 1200, 0.8),     # I = 400
    (400, 100, 400, 0.4),        # I = 16e6 / (160e3 + 40e3 + 40e3) = 66.7; 66.7 / 166.7
])
def test_the_curve_at_hand_computed_shapes(m, n, k, fraction):
    assert shape_fraction(Gemm(m, n, k), HW) == pytest.approx(fraction)
    # the time: the flat model's (waves of tiles, here 3 x 3 -> 3 waves of 4 units for 300^3) over the fraction,
    # in either precision (FP8 at its own efficiency, here the bf16 rate again)
    flat = dataclasses.replace(HW, gemm_half_intensity=None)
    for fp8 in (False, True):
        gemm = Gemm(m, n, k, fp8=fp8)
        assert gemm_seconds(gemm, HW, "bf16") == pytest.approx(gemm_seconds(gemm, flat, "bf16") / fraction)
    assert gemm_seconds(Gemm(300, 300, 300), HW, "bf16") == pytest.approx(3 * 4 * UNIT * 300 / 0.5)


def test_rows_below_one_tile_take_the_tiles_intensity():
    """A GEMM of fewer rows than a tile computes the whole tile (the padding is in the waves), so its intensity is
    the tile's: 100 rows price as 128, and 0.8 rows (an average per expert) no more -- not 1 / I times more."""
    assert shape_fraction(Gemm(100, 400, 400), HW, 128) == shape_fraction(Gemm(128, 400, 400), HW)
    times = [gemm_seconds(Gemm(m, 400, 400), HW, "bf16") for m in (0.01, 0.8, 1, 17, 100, 128)]
    assert times == [times[-1]] * len(times)


def test_the_curve_rises_with_every_dimension_and_saturates_at_the_mamf():
    rng = random.Random(26)
    for _ in range(200):
        m, n, k = (rng.choice([16, 128, 1000, 2880, 8192, 65536]) for _ in range(3))
        base = shape_fraction(Gemm(m, n, k), HW)
        assert 0 < base < 1
        for grown in (Gemm(2 * m, n, k), Gemm(m, 2 * n, k), Gemm(m, n, 2 * k)):
            assert shape_fraction(grown, HW) > base
    assert shape_fraction(Gemm(2 ** 20, 2 ** 20, 2 ** 20), HW) > 0.999
    # the rate per FLOP, without wave quantisation (no unit count), rises with the size too
    no_waves = dataclasses.replace(HW, compute_units=None, gemm_tile=(1, 1))
    rates = [Gemm(s, s, s).flops / gemm_seconds(Gemm(s, s, s), no_waves, "bf16") for s in (256, 512, 1024, 4096, 16384)]
    assert rates == sorted(rates) and len(set(rates)) == len(rates)


def test_hardware_without_the_curve_keeps_the_flat_mamf_and_a_zero_is_refused():
    h100 = load_hardware(MEASUREMENTS.parents[1] / "h100.yaml")
    old = dataclasses.replace(h100, gemm_half_intensity=None)  # an old file, without the field
    gemm = Gemm(8192, 8192, 8192)
    assert shape_fraction(gemm, old) == 1.0
    tiles = math.ceil(8192 / 128) * math.ceil(8192 / 256)
    waves = math.ceil(tiles / 132)
    rate = h100.peak_bf16_tflops * 1e12 * h100.gemm_efficiency * h100.sustained_fraction
    expected = waves * 132 * 2 * 128 * 256 * 8192 / rate
    assert gemm_seconds(gemm, old, "bf16") == pytest.approx(expected)
    assert gemm_seconds(gemm, h100, "bf16") > gemm_seconds(gemm, old, "bf16")
    with pytest.raises(InputError, match="gemm_half_intensity"):
        dataclasses.replace(h100, gemm_half_intensity=0)


def test_fp8_gemms_take_their_own_sustained_fraction_where_the_file_gives_one():
    # an FP8 GEMM (per-tensor or block-scaled) runs at fp8_sustained_fraction, a BF16 one at sustained_fraction
    base = dataclasses.replace(HW, sustained_fraction=0.8)
    split = dataclasses.replace(base, fp8_sustained_fraction=0.6)
    for gemm in (Gemm(4096, 4096, 4096, fp8=True), Gemm(4096, 4096, 4096, fp8=True, mxfp8=True)):
        assert gemm_seconds(gemm, split, "bf16") == pytest.approx(gemm_seconds(gemm, base, "bf16") * 0.8 / 0.6)
    bf16 = Gemm(4096, 4096, 4096)
    assert gemm_seconds(bf16, split, "bf16") == gemm_seconds(bf16, base, "bf16")
    # the curve's fit models isolated kernels: neither fraction enters it
    points = ((2048, 2048, 2048, 50.0), (8192, 8192, 8192, 90.0))
    assert (MeasuredGemms(hardware=split, fp8=True, source="synthetic", points=points).fit()
            == pytest.approx(MeasuredGemms(hardware=base, fp8=True, source="synthetic", points=points).fit()))
    with pytest.raises(InputError, match="fp8_sustained_fraction"):
        dataclasses.replace(HW, fp8_sustained_fraction=1.2)
    # the B200 file's: its BF16 figure times the FP8-over-BF16 ratio of the cited MSMF / MAMF rows (B200 against H200)
    b200 = load_hardware(MEASUREMENTS.parents[1] / "b200.yaml")
    fp8_part = (2795.7 / 3435.2) / (1288.7 / 1491.9) / ((1456.3 / 1770.9) / (708.5 / 841.9))
    assert b200.fp8_sustained_fraction == pytest.approx(b200.sustained_fraction * fp8_part, abs=5e-4)
    assert load_hardware(MEASUREMENTS.parents[1] / "h100.yaml").fp8_sustained_fraction is None


def test_the_fit_recovers_a_known_curve_from_points_the_model_made():
    shapes = [(1024, 1024, 1024), (2048, 4096, 2048), (512, 8192, 4096), (8192, 8192, 8192), (128, 2880, 5760)]
    truth = dataclasses.replace(HW, gemm_half_intensity=321.0, sustained_fraction=1.0)
    points = tuple((m, n, k, 2 * m * n * k / gemm_seconds(Gemm(m, n, k), truth, "bf16") / 1e12)
                   for m, n, k in shapes)
    measured = MeasuredGemms(hardware=HW, fp8=False, source="synthetic", points=points)
    assert measured.fit() == pytest.approx(321.0, rel=1e-3)
    assert max(abs(e) for e in measured.log_errors(321.0)) < 1e-9


# Stated error of the fits (docs/projection.md, "GEMMs by shape"): within 15 % rms on log time and 35 % at worst
# per set, and better than the flat MAMF on both counts.
REPO = MEASUREMENTS.parents[4]


@pytest.mark.parametrize("measured", load_measurements(),
                         ids=lambda s: f"{s.hardware.name}-{'fp8' if s.fp8 else 'bf16'}-{len(s.points)}")
def test_each_shipped_curve_fits_each_of_its_cited_measurements(measured):
    results = [word.strip(",") for word in measured.source.split() if word.startswith("bench/results/")]
    assert measured.source.startswith("https://") or (results and all((REPO / r).is_file() for r in results))
    curve, flat = measured.log_errors(measured.hardware.gemm_half_intensity), measured.log_errors(None)
    rms = math.sqrt(sum(e * e for e in curve) / len(curve))
    assert rms < 0.15 and max(map(abs, curve)) < 0.35
    assert rms < math.sqrt(sum(e * e for e in flat) / len(flat)) and max(map(abs, curve)) < max(map(abs, flat))


def test_a_set_the_project_measured_is_its_results_file():
    """Each point of a set whose source is a results file of bench/bench_gpu_kernels.py is one GEMM timed there, at the
    rate 2 m n k / the measured seconds (to the 0.1 TFLOP/s the set is written to)."""
    import json

    own = [s for s in load_measurements() if not s.source.startswith("https://")]
    assert own
    for measured in own:
        results = next(w.strip(",") for w in measured.source.split() if w.startswith("bench/results/"))
        kind = f"gemm {'fp8' if measured.fp8 else 'bf16'}"
        timed = sorted((c["shape"]["m"], c["shape"]["n"], c["shape"]["k"], 2 * c["shape"]["m"] * c["shape"]["n"]
                        * c["shape"]["k"] / c["measured_s"] / 1e12)
                       for c in json.loads((REPO / results).read_text())["cases"] if c["kind"] == kind)
        assert [p[:3] for p in sorted(measured.points)] == [t[:3] for t in timed]
        assert [p[3] for p in sorted(measured.points)] == pytest.approx([t[3] for t in timed], abs=0.051)


@pytest.mark.parametrize("group", list(by_hardware_file(load_measurements()).values()),
                         ids=lambda g: g[0].hardware.name)
def test_each_shipped_curve_is_the_fit_of_all_its_files_measurements_together(group):
    assert group[0].hardware.gemm_half_intensity == pytest.approx(fit(group), rel=0.01)


def test_a_file_measured_twice_fits_between_its_sets():
    """The pooled fit of two sets lies between their own fits, nearer the one with more points when both pull alike."""
    h100 = by_hardware_file(load_measurements())[next(p for p in by_hardware_file(load_measurements())
                                                      if p.endswith("h100.yaml"))]
    own = sorted(s.fit() for s in h100)
    assert len(h100) >= 2 and own[0] < fit(h100) < own[-1]


def test_a_malformed_measurement_is_named(tmp_path):
    (tmp_path / "h100.yaml").write_text((MEASUREMENTS.parents[1] / "h100.yaml").read_text())
    bad = tmp_path / "gemm_measurements.yaml"
    bad.write_text("sets:\n  - hardware: h100.yaml\n    precision: fp8\n    source: https://x\n"
                   "    points:\n      - [1024, 1024, 274.1]\n")
    with pytest.raises(InputError, match=r"sets\[0\]\.points"):
        load_measurements(bad)
    bad.write_text("sets:\n  - hardware: h100.yaml\n    precision: fp4\n    source: https://x\n"
                   "    points: [[1, 1, 1, 1]]\n")
    with pytest.raises(InputError, match="precision bf16 or fp8"):
        load_measurements(bad)


def test_with_a_smallest_tile_the_library_halves_its_tile_where_units_would_idle():
    amd = dataclasses.replace(HW, gemm_half_intensity=None, gemm_min_tile=(64, 64))
    k = 1024
    # one 128 x 128 tile leaves 3 of 4 units idle: four 64 x 64 tiles fill the wave, a quarter of the time
    assert library_tile(Gemm(128, 128, k), amd) == (64, 64)
    assert gemm_seconds(Gemm(128, 128, k), amd, "bf16") == pytest.approx(UNIT * k)  # 4 units x a quarter tile
    assert library_tile(Gemm(128, 128, k), HW) == (128, 128)  # without gemm_min_tile: always gemm_tile
    # a tie (4 full tiles, or 8 half ones in 2 waves) keeps the larger tile; 64 rows pad no 64-row tile
    assert library_tile(Gemm(512, 128, k), amd) == (128, 128)
    assert library_tile(Gemm(64, 512, k), amd) == (64, 128)
    for bad in ((256, 64), (0, 64), (64,)):
        with pytest.raises(InputError, match="gemm_min_tile"):
            dataclasses.replace(HW, gemm_min_tile=bad)
