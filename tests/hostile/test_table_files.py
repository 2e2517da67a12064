"""Schedule files (JSON, torch CSV and its sidecar): every field strict, documents bounded, each
refusal one line naming the file and the field."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import refused, run_cli
from primuspipe.algorithms.build import build_schedule
from primuspipe.io.formats import save_table

TABLE = json.loads(build_schedule("1f1b", pp=2, microbatches=3).to_json())


def _write(tmp_path, data, name="t.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("field, value, names", [
    ("microbatches", 2.5, ["microbatches", "integer"]),
    ("microbatches", "3", ["microbatches"]),
    ("microbatches", True, ["microbatches"]),
    ("microbatches", "３", ["microbatches"]),
    ("microbatches", 0, ["microbatches"]),
    ("microbatches", -3, ["microbatches"]),
    ("microbatches", None, ["microbatches"]),
    ("microbatches", 10**12, ["microbatches", "nodes"]),
    ("pp", 3, ["pp"]),
    ("pp", 2.0, ["pp"]),
    ("vpp", 0, ["vpp"]),
    ("version", True, ["version"]),
    ("version", 2, ["version"]),
    ("version", "1", ["version"]),
    ("format", "primuspipe.timeline", ["format"]),
    ("algorithm", 7, ["algorithm"]),
    ("ranks", "F0.0", ["ranks"]),
    ("ranks", [["F0.0"]], ["rank"]),
    ("ranks", [["F0.0", "F9.0"], ["F0.0"]], ["F9.0"]),
    ("ranks", [["F0.x"], []], ["F0.x"]),
    ("ranks", [["F０.0"], []], ["F０.0"]),
    ("placement", {"name": "interleaved", "stages": [[0], [0]]}, ["stage"]),
    ("nosuchkey", 1, ["nosuchkey"]),
])
def test_json_fields(tmp_path, field, value, names):
    path = _write(tmp_path, {**TABLE, field: value})
    refused(run_cli(["validate", path]), str(path), *names, case=f"table {field}={value!r}")


@pytest.mark.parametrize("text, names", [
    ('{"microbatches": NaN}', ["NaN"]),
    ('{"microbatches": Infinity}', ["Infinity"]),
    ('{"microbatches": 1e999}', ["1e999"]),
    ('{"a": 1, "a": 2}', ["twice"]),
    ("[" * 5000 + "]" * 5000, ["deep"]),
    ("", ["JSON"]),
    ("{", ["JSON"]),
    ("null", ["primuspipe.schedule"]),
    ("[]", ["primuspipe.schedule"]),
])
def test_json_documents(tmp_path, text, names):
    path = _write(tmp_path, text)
    refused(run_cli(["validate", path]), *names, case=f"table document {text[:20]!r}")


def test_binary_missing_and_directory(tmp_path):
    binary = tmp_path / "t.json"
    binary.write_bytes(b"\xff\xfe\x00bad")
    refused(run_cli(["validate", binary]), "UTF-8", case="table binary")
    refused(run_cli(["validate", tmp_path / "none.json"]), "does not exist", case="table missing")
    refused(run_cli(["validate", tmp_path]), "directory", case="table directory")
    odd = tmp_path / "[/x] [bold].json"
    refused(run_cli(["validate", odd]), "[/x] [bold].json", case="table path with markup")


@pytest.mark.parametrize("text, names", [
    ("0F0,0F1,0B0\n1F0,1B0\n", ["B"]),  # incomplete
    ("0F0,0B0\n1F０,1B0\n", ["F０"]),
    ("0F0.5,0B0\n1F0,1B0\n", ["F0.5"]),
    ("0X0,0B0\n1F0,1B0\n", ["X0"]),
    ("0F-1,0B0\n1F0,1B0\n", ["F-1"]),
    ("", ["no actions"]),
])
def test_torch_csv(tmp_path, text, names):
    path = _write(tmp_path, text, "t.csv")
    refused(run_cli(["validate", path]), *names, case=f"csv {text[:16]!r}")


@pytest.mark.parametrize("meta, names", [
    ({"microbatches": 2.5}, ["microbatches"]),
    ({"microbatches": True}, ["microbatches"]),
    ({"microbatches": 3, "pp": 4}, ["pp=4"]),
    ({"microbatches": 3, "colour": "red"}, ["colour"]),
])
def test_csv_sidecar(tmp_path, meta, names):
    path = tmp_path / "t.csv"
    save_table(build_schedule("1f1b", pp=2, microbatches=3, communication=False), path, compute_only=True)
    side = tmp_path / "t.csv.meta.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), **meta}))
    refused(run_cli(["validate", path]), *names, case=f"csv sidecar {meta}")


BAD_VALUES = st.one_of(st.sampled_from([1.5, -1, True, False, None, "x", "２", [], {}, 10**15, float("nan")]),
                       st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)))


@settings(max_examples=30)
@given(st.sampled_from(["pp", "vpp", "microbatches", "version"]), BAD_VALUES)
def test_generated_bad_header_values(tmp_path_factory, field, value):
    path = tmp_path_factory.mktemp("t") / "t.json"
    path.write_text(json.dumps({**TABLE, field: value}))
    refused(run_cli(["validate", path]), case=f"table {field}={value!r}")
