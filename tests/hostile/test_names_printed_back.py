"""Names read from input files and printed back -- a schedule's algorithm, its placement's name, a construction's
name and paper, a torch CSV sidecar's algorithm, a timeline's algorithm and time unit, a cost file's time unit, and
every text field of the projection's model, training and hardware files (listed from their types, so a new one joins
the sweep) -- holding a newline, a terminal escape sequence, a right-to-left override, a tab, a NUL or a zero-width
space. Each is one line naming the field; the printable names beside them (other scripts, spaces) are read.

Defects this family found: ``validate`` printed a JSON table's algorithm ``"a\\nb"`` in its verdict over two lines
(a script reading the first saw ``valid: t.json (full table, a``), and one holding ``\\x1b[2J`` cleared the terminal;
a Primus header's ``algorithm=zb\\u202ev`` was printed back as it was; a model's ``name`` with an escape sequence was printed in
``project``'s report title. Text fields took any non-empty string (``strict.text``, the projection's ``str`` reader).
"""

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import yaml

from hostile_support import accepted, refused, run_cli
from primuspipe.algorithms.build import build_schedule
from primuspipe.io.formats import save_table
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
BAD = {"newline": "a\nb", "escape": "x\x1b[2J", "rtl override": "zb\u202ev", "tab": "a\tb", "NUL": "a\x00b",
       "zero-width space": "zb\u200bv"}
GOOD = {"other script": "调度-α", "inner space": "my schedule"}


def _table_json(tmp_path, edit) -> list:
    table = build_schedule("zb-auto", 2, 4)  # a table with a construction (name and paper)
    data = table.to_dict()
    edit(data)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    return ["validate", path]


def _csv_sidecar(tmp_path, value) -> list:
    [csv, sidecar] = save_table(build_schedule("1f1b", 2, 4), tmp_path / "t.csv", "csv")
    data = json.loads(sidecar.read_text())
    data["algorithm"] = value
    sidecar.write_text(json.dumps(data))
    return ["validate", csv]


def _timeline(tmp_path, key, value) -> list:
    assert run_cli(["simulate", "-a", "1f1b", "--pp", "2", "-m", "4", "-o", tmp_path / "sim"]).code == 0
    path = next((tmp_path / "sim").glob("*.timeline.json"))
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))
    return ["vis", path, "--json"]


def _cost_file(tmp_path, value) -> list:
    path = tmp_path / "cost.yaml"
    path.write_text(yaml.safe_dump({"time_unit": value, "compute": {"f": 1.0, "b": 1.0, "w": 1.0}}))
    return ["simulate", "-a", "1f1b", "--pp", "2", "-m", "4", "--cost", path]


def _placement_name(data, value):
    data["placement"]["name"] = value
    data["placement"]["stages"] = data["placement"]["stages"]  # custom name, same stages


DOORS = {
    "table algorithm": (lambda tmp, v: _table_json(tmp, lambda d: d.update(algorithm=v)), "algorithm"),
    "table placement name": (lambda tmp, v: _table_json(tmp, lambda d: _placement_name(d, v)), "name"),
    "construction name": (lambda tmp, v: _table_json(tmp, lambda d: d["construction"].update(name=v)),
                          "construction.name"),
    "construction paper": (lambda tmp, v: _table_json(tmp, lambda d: d["construction"].update(paper=v)),
                           "construction.paper"),
    "csv sidecar algorithm": (_csv_sidecar, "algorithm"),
    "timeline algorithm": (lambda tmp, v: _timeline(tmp, "algorithm", v), "algorithm"),
    "timeline time_unit": (lambda tmp, v: _timeline(tmp, "time_unit", v), "time_unit"),
    "cost time_unit": (_cost_file, "time_unit"),
}
"""Where a file's name is read -> (the command reading a file with ``value`` there, the field the refusal names)."""


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("what", sorted(BAD))
def test_schedule_and_timeline_names(tmp_path, door, what):
    command, field = DOORS[door]
    refused(run_cli(command(tmp_path, BAD[what])), field, case=f"{door} with a {what}")


@pytest.mark.parametrize("door", ["table algorithm", "table placement name", "construction name", "timeline algorithm"])
@pytest.mark.parametrize("what", sorted(GOOD))
def test_printable_names_are_read(tmp_path, door, what):
    accepted(run_cli(DOORS[door][0](tmp_path, GOOD[what])), case=f"{door} in {what}")


SPECS = {"model": (ModelSpec, EXAMPLES / "models" / "mixtral-8x7b.yaml"),
         "training": (TrainingSpec, EXAMPLES / "training" / "mixtral-8x7b.yaml"),
         "hardware": (HardwareSpec, EXAMPLES / "hardware" / "h100.yaml")}


def _text_fields(cls) -> list[tuple[str, typing.Any]]:
    """The fields of ``cls`` that hold text: a name, a list of names, or a mapping keyed by names."""
    def holds_text(hint) -> bool:
        if hint is str:
            return True
        return typing.get_origin(hint) is not typing.Literal and any(holds_text(a) for a in typing.get_args(hint))

    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.name != "source" and holds_text(hints[f.name])]


def _spelt(hint, base_value, text: str):
    """``text`` where a field of type ``hint`` holds a name: itself, inside a list, or as a mapping's key."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if str in kinds:
        return text
    kind = typing.get_origin(kinds[0])
    if kind is tuple:
        return [text]
    assert kind is dict, hint
    return {text: next(iter(base_value.values()))}


PROJECTION_CASES = [(kind, name, hint) for kind, (cls, _) in SPECS.items() for name, hint in _text_fields(cls)]


@pytest.mark.parametrize("kind, name, hint", PROJECTION_CASES, ids=[f"{k}.{n}" for k, n, _ in PROJECTION_CASES])
@pytest.mark.parametrize("what", sorted(BAD))
def test_projection_text_fields(tmp_path, kind, name, hint, what):
    files = {k: path for k, (_, path) in SPECS.items()}
    data = yaml.safe_load(files[kind].read_text())
    data[name] = _spelt(hint, data.get(name), BAD[what])
    files[kind] = tmp_path / f"{kind}.yaml"
    files[kind].write_text(yaml.safe_dump(data))
    outcome = run_cli(["project", "--model", files["model"], "--training", files["training"], "--hardware",
                       files["hardware"], "-a", "1f1b", "--json"])
    refused(outcome, name, case=f"project {kind}.{name} with a {what}")
