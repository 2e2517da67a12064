"""Calibrating the analytical compute times from a real run's per-node timings.

``primuspipe calibrate pp_data/ -o measured.yaml`` turns a ``dump_pp_data`` dump into a cost file: F,
B and W seconds per pipeline stage of the run. Given the model and training configuration that run
used, each pass's factor is what the run measured over what the projection computes for the same
shape, communication taken out of both sides::

    factor(pass) = (sum over stages of measured(pass) - modelled collectives(pass))
                   / sum over stages of modelled compute(pass)

The factors then scale the compute of every projected configuration (other pp, vpp, micro-batch
sizes, algorithms), as a layer benchmark's do. A run with fused backward (BW nodes) measures no B/W
split; its cost file carries ``bw``, whose total is then split in the modelled B/W ratio.
"""

from __future__ import annotations

from pathlib import Path

from primuspipe.projection.compute import PARTS, PASSES, Calibration, WorkModel, part_times
from primuspipe.projection.framework import CostModel, Placement
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.spec_fields import InputError
from primuspipe.projection.stage_costs import stage_costs
from primuspipe.projection.training_spec import TrainingSpec

SECONDS_PER_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def calibration_from_cost_file(path: str | Path, model: ModelSpec, training: TrainingSpec,
                               hardware: HardwareSpec) -> Calibration:
    """Factors from a measured cost file of a run of ``model`` under ``training`` (its pp and vpp)."""
    measured = CostModel.load(path, pp=training.pp, vpp=training.vpp)
    unit = SECONDS_PER_UNIT[measured.time_unit]
    modelled = stage_costs(model, training, hardware, part_times(WorkModel(model, training), hardware, Calibration()),
                           Placement.interleaved(training.pp, training.vpp))
    c = measured.compute
    model_totals = (sum(modelled.forward), sum(modelled.backward_input), sum(modelled.backward_weight))
    if measured.fused_backward is not None:  # BW nodes measure no B/W split: split their total as modelled
        _, b, w = model_totals
        fused = sum(measured.fused_backward)
        totals = (sum(c.forward), fused * b / (b + w), fused * w / (b + w))
    else:
        totals = (sum(c.forward), sum(c.backward_input), sum(c.backward_weight))
    factors = {}
    for name, seen, total, waits in zip(PASSES, totals, model_totals, modelled.communication):
        compute = total - waits
        if compute <= 0 or seen * unit <= waits:
            raise InputError([(str(path), "compute", name)],
                             "the measured time does not exceed the modelled communication",
                             "check that the cost file comes from a run of this model and training configuration")
        factors.update({(part, name): (seen * unit - waits) / compute for part in PARTS})
    return Calibration(factors, source=f"calibrated from {Path(path).name}")
