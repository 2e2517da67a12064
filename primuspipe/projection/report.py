"""The projection's two outputs: a ranked rich table for people and one JSON document for scripts.

JSON (``primuspipe project --json``)::

    {"model": ..., "hardware": ..., "gpus": N, "calibration": "analytical" | ...,
     "results": [{"algorithm", "pp", "vpp", "micro_batch_size", "recompute", "step_time_s", "bubble_rate",
                  "peak_memory_bytes": [per rank], "memory_breakdown": {...}, "tokens_per_s_per_gpu", "mfu",
                  "mfu_full_attention", "exposed_communication_s", "verdict", "note", ...}, ...],  # ranked, best first
     "refused": [{"algorithm", "pp", "vpp", "micro_batch_size", "recompute", "error"}, ...],
     "parameters": {"total": N, "per_rank": [per pipeline rank of the given configuration]},
     "memory": {"dense": {component: bytes}, "moe": {...}},   # one layer, one microbatch, one rank
     "moe_small_kernels": {"kernels": [F, B, W], "seconds": [F, B, W]}}   # one MoE layer and microbatch; MoE only
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from primuspipe.projection.activations import ActivationModel
from primuspipe.projection.compute import WorkModel, kernel_overheads
from primuspipe.projection.framework import Placement
from primuspipe.projection.host import moe_small_kernels
from primuspipe.projection.layout import StageLayout
from primuspipe.projection.parameters import rank_params, total_params
from primuspipe.projection.projection import Projector, ProjectionResult, Refusal
from primuspipe.projection.training_spec import TrainingSpec

GIB = 2**30
VERDICT_STYLE = {"FITS": "green", "AT-RISK": "yellow", "OOM": "bold red"}


def report_dict(projector: Projector, training: TrainingSpec, results: list[ProjectionResult],
                refusals: list[Refusal]) -> dict[str, Any]:
    """The JSON document (module docstring)."""
    model = projector.model
    layout = StageLayout.build(model.num_layers, training, Placement.interleaved(training.pp, training.vpp))
    activations = ActivationModel(model, training)
    return {
        "model": model.name, "hardware": projector.hardware.name, "gpus": training.world_size,
        "calibration": projector.calibration.source,
        "results": [r.row() for r in results],
        "refused": [r.row() for r in refusals],
        "parameters": {"total": total_params(model), "per_rank": [p.total for p in rank_params(model, training, layout)]},
        "memory": {kind: activations.layer(kind).components for kind in sorted(set(model.layer_kinds))},
    } | ({"moe_small_kernels": small_kernels(projector, training)} if model.is_moe else {})


def small_kernels(projector: Projector, training: TrainingSpec) -> dict[str, list[float]]:
    """The small kernels of one MoE layer and microbatch per pass and the device seconds they add
    (``moe_kernel_seconds`` each, ``stream_launch_gap_seconds`` more each one no CUDA graph captures; 0 where
    the hardware file does not give ``moe_kernel_seconds``)."""
    kernels = moe_small_kernels(projector.model, training)
    seconds = kernel_overheads(WorkModel(projector.model, training), projector.hardware, "moe")
    return {"kernels": list(kernels), "seconds": list(seconds)}


def print_report(console: Console, projector: Projector, training: TrainingSpec, results: list[ProjectionResult],
                 refusals: list[Refusal], *, top: int) -> None:
    """The ranked table, then what was not projected and why."""
    h = projector.hardware
    table = Table(title=f"{projector.model.name} on {training.world_size} x {h.name} "
                        f"(TP {training.tp}, CP {training.cp}, EP {training.ep}, GBS {training.global_batch_size}, "
                        f"{h.hbm_bytes / GIB:.0f} GiB HBM; times: {projector.calibration.source}), ranked by tokens/s per GPU")
    for name, justify in (("#", "right"), ("algorithm", "left"), ("pp", "right"), ("vpp", "right"), ("dp", "right"),
                          ("mbs", "right"), ("recompute", "left"), ("step (s)", "right"), ("bubble", "right"),
                          ("peak GiB", "right"), ("weights+grads+opt / act GiB", "right"), ("tokens/s/GPU", "right"),
                          ("MFU", "right"), ("MFU full", "right"), ("exposed comm s", "right"), ("verdict", "left")):
        table.add_column(name, justify=justify, no_wrap=name in ("algorithm", "recompute"))
    for k, r in enumerate(results[:top], 1):
        b = r.memory_breakdown
        static = b["weights"] + b["gradients"] + b["optimizer"]
        dynamic = b["activations"] + b["recompute_working_set"]
        table.add_row(str(k), r.algorithm, str(r.pp), str(r.vpp), str(r.data_parallel_size), str(r.micro_batch_size),
                      r.recompute, f"{r.step_time_s:.3f}", f"{r.bubble_rate:.3f}", f"{max(r.peak_memory_bytes) / GIB:.1f}",
                      f"{static / GIB:.1f} / {dynamic / GIB:.1f}", f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.mfu:.1%}",
                      f"{r.mfu_full_attention:.1%}", f"{r.exposed_communication_s:.2f}",
                      Text(r.verdict, style=VERDICT_STYLE[r.verdict]))
    console.print(table)
    if projector.model.is_moe:
        small = small_kernels(projector, training)
        console.print(f"small MoE kernels per MoE layer and microbatch (F/B/W): "
                      f"{'/'.join(f'{n:.0f}' for n in small['kernels'])}, adding "
                      f"{sum(small['seconds']) * 1e3:.2f} ms of device time (moe_kernel_seconds of {h.name}"
                      f"{'' if h.moe_kernel_seconds else ': not given, not modelled'})", highlight=False)
    for k, r in enumerate(results[:top], 1):
        if r.note:
            console.print(f"#{k} {r.algorithm}: {r.note}", highlight=False)
    if sampled := {r.simulated_microbatches for r in results[:top] if r.simulated_microbatches}:
        counts = " / ".join(", ".join(map(str, c)) for c in sorted(sampled))
        console.print(f"{results[0].microbatches} microbatches per replica: pipelines simulated at {counts} and carried "
                      "on linearly (past the warm-up each microbatch repeats the same steady pattern; tables whose "
                      "memory follows no line were simulated whole)", highlight=False)
    if flushed := sorted({(r.pipeline_flushes, r.microbatches // r.pipeline_flushes) for r in results[:top]
                          if r.pipeline_flushes > 1}):
        console.print("pipeline schedules a step (local_batch_size), each with its own warm-up and drain: "
                      + ", ".join(f"{n} of {m} microbatches" for n, m in flushed), highlight=False)
    if len(results) > top:
        console.print(f"({len(results) - top} more; --top N shows more, --json shows all)")
    reasons = Counter(r.error for r in refusals)
    for r in refusals if len(refusals) <= top else []:
        console.print(Text.assemble(("not projected:", "yellow"), f" {r.algorithm} pp={r.pp} vpp={r.vpp} "
                                    f"mbs={r.micro_batch_size} {r.recompute}: {r.error}"), highlight=False)
    for reason, count in reasons.most_common(top) if len(refusals) > top else []:
        console.print(Text.assemble((f"{count} candidates not projected:", "yellow"), f" {reason}"), highlight=False)
