"""Published, measured training runs, and the projection of each: how far the model is from reality.

``bench/data/published_runs.yaml`` lists runs from public sources (NVIDIA's benchmark recipes and
performance summaries, the Llama 3 paper, ...) with the layout they ran and the throughput they
reported. :func:`project_run` projects one the way the run was made -- the model and hardware files
shipped in ``examples/projection/``, the run's training settings, data parallelism from its GPU
count, Megatron's schedule for its layout (interleaved 1F1B with vpp > 1, else 1F1B) -- and compares
tokens/s per GPU (a figure published as model TFLOP/s is turned into tokens/s with the model FLOPs per
token under the convention the source counts in).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primuspipe.projection.compute import FLOP_CONVENTIONS, model_flops_per_token
from primuspipe.projection.framework import ConfigError, PrimusPipeError
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.projection import ProjectionResult, Projector
from primuspipe.projection.spec_fields import read_yaml, spec_from_mapping
from primuspipe.projection.training_spec import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
RUNS_FILE = ROOT / "bench" / "data" / "published_runs.yaml"
EXAMPLES = ROOT / "examples" / "projection"


@dataclass(frozen=True)
class PublishedRun:
    """One row of the published-runs table."""

    id: str
    source: str
    url: str
    model: str
    hardware: str
    gpus: int
    training: Mapping[str, Any]
    published: Mapping[str, Any]
    assumed: tuple[str, ...] = ()
    notes: str = ""
    held_out: bool = False
    excluded: str = ""
    """Why the row is shown but not held to the accuracy goal (an inconsistent source); empty: counted."""
    lower_bound: bool = False
    """The figure is a level the run is expected to reach (a validation suite's pass threshold), not a
    measurement: the projection is held to reach it (ratio >= 0.9), not to match it."""
    seq_length: int | None = None
    """The run's tokens per sample where they differ from the model file's (a long-context run of the same
    model); None: the model file's."""

    def algorithm(self) -> str:
        """The schedule Megatron runs for this layout."""
        return "interleaved-1f1b" if self.training.get("virtual_pipeline_model_parallel_size", 1) > 1 else "1f1b"


def load_runs(path: Path = RUNS_FILE) -> list[PublishedRun]:
    data = read_yaml(path, "published runs")
    runs = []
    for k, row in enumerate(data.get("runs") or []):
        if not isinstance(row, Mapping):
            raise ConfigError(f"{path}: runs[{k}] must be a mapping of a run's fields")
        values = dict(row)
        values["assumed"] = tuple(values.get("assumed") or ())
        runs.append(PublishedRun(**values))
    return runs


def published_tokens_per_s(run: PublishedRun, flops_per_token: Mapping[str, float]) -> float:
    """The run's published throughput in tokens/s per GPU."""
    figures = run.published
    if "tokens_per_s_per_gpu" in figures:
        return float(figures["tokens_per_s_per_gpu"])
    convention = figures.get("flops_convention")
    if convention not in FLOP_CONVENTIONS:
        raise ValueError(f"{run.id}: published.flops_convention must be one of {FLOP_CONVENTIONS}, got {convention!r}")
    return float(figures["model_tflops_per_gpu"]) * 1e12 / flops_per_token[convention]


def model_of(run: PublishedRun) -> ModelSpec:
    """The run's model: the shipped model file, at the run's sequence length where the row gives one."""
    model = load_model(EXAMPLES / "models" / f"{run.model}.yaml")
    return model if run.seq_length is None else dataclasses.replace(model, seq_length=run.seq_length)


def training_of(run: PublishedRun, hardware_gpus: int | None = None) -> TrainingSpec:
    """The run's training settings with data parallelism from its GPU count."""
    t = dict(run.training)
    per_replica = (t.get("tensor_model_parallel_size", 1) * t.get("pipeline_model_parallel_size", 1)
                   * t.get("context_parallel_size", 1))
    if run.gpus % per_replica:
        raise ValueError(f"{run.id}: {run.gpus} GPUs do not hold whole TP*PP*CP = {per_replica} replicas")
    t["data_parallel_size"] = run.gpus // per_replica
    return spec_from_mapping(TrainingSpec, t, f"{RUNS_FILE.name}: {run.id}")


def project_run(run: PublishedRun) -> dict[str, Any]:
    """Project one published run; the row of the comparison (``error`` instead of figures when refused)."""
    start = time.perf_counter()
    row: dict[str, Any] = {"id": run.id, "model": run.model, "hardware": run.hardware, "gpus": run.gpus,
                           "held_out": run.held_out, "excluded": run.excluded, "lower_bound": run.lower_bound,
                           "source": run.source, "url": run.url}
    try:
        model = model_of(run)
        hardware = load_hardware(EXAMPLES / "hardware" / f"{run.hardware}.yaml")
        flops = {c: model_flops_per_token(model, c) for c in FLOP_CONVENTIONS}
        row["published_tokens_per_s_per_gpu"] = published_tokens_per_s(run, flops)
        training = training_of(run)
        outcome = Projector(model, hardware).evaluate(training, run.algorithm())
    except (PrimusPipeError, ValueError, TypeError) as exc:
        return row | {"error": str(exc).splitlines()[0], "seconds": time.perf_counter() - start}
    if not isinstance(outcome, ProjectionResult):
        return row | {"error": outcome.error, "seconds": time.perf_counter() - start}
    r = outcome
    return row | {
        "projected_tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
        "ratio": r.tokens_per_s_per_gpu / row["published_tokens_per_s_per_gpu"],
        "verdict": r.verdict, "peak_memory_gib": max(r.peak_memory_bytes) / 2**30,
        "hbm_gib": hardware.hbm_bytes / 2**30, "step_time_s": r.step_time_s, "bubble_rate": r.bubble_rate,
        "mfu": dataclasses.asdict(r).get("mfu"), "algorithm": r.algorithm,
        "seconds": time.perf_counter() - start,
    }
