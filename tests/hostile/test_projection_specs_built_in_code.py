"""Round fifteen: the projection's specs (``ModelSpec``, ``TrainingSpec``, ``HardwareSpec`` and a hardware file's
``AttentionKernel``; docs/projection.md) built in code rather than read from a YAML file -- each field, in turn, at
values of another type generated from its own annotation (so a new field joins the sweep), and each number below
zero, NaN, infinite, as text, and each choice outside its values.

Their loaders checked every field (``spec_fields.coerce``), the specs themselves only what relates fields: so
``TrainingSpec(micro_batch_size=0.5)``, ``pipeline_model_parallel_size=True``, ``sequence_parallel="yes"`` and
``precision="fp64"``, ``HardwareSpec(gpus_per_node=8.5)`` were projected without a word, and
``HardwareSpec(hbm_bytes="80e9")`` was a TypeError in its range check. Now each is one line naming the field,
checked by the rules the files are read by (``spec_fields.check_fields``)."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from hostile_support import accepted, refused, run_api, wrong_values
from primuspipe.projection.hardware_spec import AttentionKernel, HardwareSpec, load_hardware
from primuspipe.projection.model_spec import ModelSpec, load_model
from primuspipe.projection.training_spec import TrainingSpec, load_training

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
VALID = {ModelSpec: load_model(EXAMPLES / "models" / "deepseek-v2-lite.yaml"),
         TrainingSpec: load_training(EXAMPLES / "training" / "mixtral-8x7b.yaml"),
         HardwareSpec: load_hardware(EXAMPLES / "hardware" / "mi355x.yaml"),
         AttentionKernel: AttentionKernel(0.5, ((2048.0, 0.9), (8192.0, 1.0)), ((2048.0, 0.6), (8192.0, 0.8)))}
"""A valid spec of each class, read from a shipped file (each case below changes one field)."""


def _members(hint) -> tuple:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, type(int | None)) else (hint,)


def _bad_values(hint) -> list:
    """:func:`wrong_values` of the annotation, and what its type admits but the files refuse: a number below
    zero, NaN, infinite or written as text; a choice outside its values."""
    members = _members(hint)
    values = wrong_values(hint)
    if int in members:
        values += [-1, math.inf, 2**0.5, "4"]
    if float in members:
        values += [-1.0, math.inf, -math.inf, "1e9"]
    for member in members:
        if typing.get_origin(member) is typing.Literal:
            values += ["not-a-choice", True, *(str(a).upper() for a in typing.get_args(member) if isinstance(a, str))]
    return values


def _cases():
    for cls, spec in VALID.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name == "source":
                continue
            for i, value in enumerate(_bad_values(hints[field.name])):
                yield f"{cls.__name__}.{field.name}={value!r:.24}#{i}", spec, field.name, value


CASES = list(_cases())


@pytest.mark.parametrize("case, spec, name, value", CASES, ids=[c[0] for c in CASES])
def test_a_spec_field_built_in_code(case, spec, name, value):
    """Refused when built, naming the field."""
    refused(run_api(dataclasses.replace, spec, **{name: value}), name, case=f"built in code: {case}")


@pytest.mark.parametrize("cls", VALID, ids=[c.__name__ for c in VALID])
def test_the_valid_specs_are_accepted(cls):
    """The spec each case changes one field of builds again as it is, lists where tuples belong and whole floats
    where integers belong too (sound), and comes out as what its file would have made."""
    spec = VALID[cls]
    accepted(run_api(dataclasses.replace, spec), case=f"built in code: {cls.__name__}")
    hints = typing.get_type_hints(cls)
    loose = {f.name: list(v) if isinstance(v, tuple) else float(v) if int in _members(hints[f.name]) and
             type(v) is int else v for f in dataclasses.fields(cls) for v in [getattr(spec, f.name)]}
    accepted(run_api(cls, **loose), case=f"built in code: {cls.__name__} (lists, whole floats)")
    assert cls(**loose) == spec
