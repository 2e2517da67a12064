"""Run dumps (``vis``, ``calibrate``): only whole iterations of one run, with sane times, are read; an
iteration that is partial, mixed, duplicated or from another run is refused when asked for and
skipped with a warning naming it otherwise; nothing a later command reads is written on failure."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import make_dump, not_valid_afterwards, record, refused, run_cli
from primuspipe.io.timeline import dump_path

def _edit(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_a_whole_dump_reads(tmp_path):
    assert run_cli(["vis", make_dump(tmp_path / "d"), "--json"]).code == 0
    assert run_cli(["calibrate", tmp_path / "d", "--warmup", "0"]).code == 0


def _computes(data):
    return [e for e in data["ranks"][0]["events"] if "_" not in e["node"]]


def _negate(data):
    for e in data["ranks"][0]["events"]:
        e["start"], e["end"] = -e["end"], -e["start"]


@pytest.mark.parametrize("edit, names", [
    (_negate, ["start", ">= 0"]),
    (lambda d: d["ranks"][0]["events"][0].update(end=-1.0), ["end"]),
    (lambda d: d["ranks"][0]["events"][0].update(start="1e999"), ["start"]),
    (lambda d: _computes(d)[-1].update(end=1e30), ["end", "<= 1e+12"]),
    (lambda d: _computes(d)[-1].update(start=1e13, end=2e13), ["start", "<= 1e+12"]),
    (lambda d: _computes(d)[1].update(start=0.0), ["before the rank's previous compute node ends"]),
    (lambda d: d["ranks"][0].update(peak_memory_bytes=-5), ["peak_memory_bytes"]),
    (lambda d: d["ranks"][0].update(peak_memory_bytes=1.5), ["peak_memory_bytes"]),
    (lambda d: d["meta"].update(t0_unix=-1), ["t0_unix"]),
    (lambda d: d["meta"].pop("t0_unix"), ["t0_unix"]),
    (lambda d: d.update(iteration=7), ["iteration 7"]),
    (lambda d: d.update(pp=2), ["rank must be <= 1"]),
    (lambda d: d.update(time_unit="fortnights"), ["time_unit"]),
    (lambda d: d["ranks"][0]["events"][0].update(node="F99.0"), ["F99.0"]),
    (lambda d: d["ranks"][0]["events"][0].update(colour="red"), ["colour"]),
])
@pytest.mark.parametrize("command", ["vis", "calibrate"])
def test_bad_rank_file_in_the_only_iteration(tmp_path, edit, names, command):
    dump = make_dump(tmp_path / "d", iterations=(0,))
    _edit(dump_path(dump, 0, 2), edit)
    out = tmp_path / "cost.yaml"
    argv = ["vis", dump, "--iteration", "0"] if command == "vis" else ["calibrate", dump, "-o", out, "--warmup", "0"]
    refused(run_cli(argv), *names, case=f"{command} dump edit {names[0]}")
    not_valid_afterwards(out)


def test_nan_literal_in_a_dump(tmp_path):
    dump = make_dump(tmp_path / "d", iterations=(0,))
    path = dump_path(dump, 0, 1)
    path.write_text(path.read_text().replace('"start": 0.0', '"start": NaN', 1))
    refused(run_cli(["vis", dump, "--iteration", "0"]), "NaN", case="dump NaN literal")


def test_run_killed_mid_step(tmp_path):
    """The last iteration has 2 of 4 rank files: asked for, it is refused naming the missing ranks; by
    default vis draws the last whole one and calibrate folds in only whole ones, both saying which
    iteration they skipped and why."""
    dump = make_dump(tmp_path / "d", iterations=(0, 1))
    for rank in (2, 3):
        dump_path(dump, 1, rank).unlink()
    refused(run_cli(["vis", dump, "--iteration", "1"]), "incomplete", "2, 3", case="dump partial iteration asked for")
    for argv in (["vis", dump, "--json"], ["calibrate", dump, "--warmup", "0"]):
        outcome = run_cli(argv)
        assert outcome.code == 0, outcome.err
        assert "warning: skipped iteration 1" in outcome.err and "incomplete" in outcome.err
    assert json.loads(run_cli(["vis", dump, "--json"]).out)["timeline"]["iteration"] == 0
    only_partial = make_dump(tmp_path / "p", iterations=(0,), ranks={0, 1})
    for command in ("vis", "calibrate"):
        refused(run_cli([command, only_partial]), "no whole iteration", "missing", case=f"{command} only partial")


def test_duplicate_mixed_and_foreign_rank_files(tmp_path):
    dup = make_dump(tmp_path / "dup", iterations=(0,))
    shutil.copy(dump_path(dup, 0, 1), dump_path(dup, 0, 3))
    refused(run_cli(["vis", dup]), "rank_3.json", "holds rank(s) [1]", case="dump duplicate rank file")
    mixed = make_dump(tmp_path / "mixed", iterations=(0,))
    make_dump(tmp_path / "mixed", iterations=(0,), run_id="run-b", ranks={3})
    refused(run_cli(["calibrate", mixed]), "different runs", case="dump mixed runs")
    shapes = make_dump(tmp_path / "shapes", iterations=(0,))
    make_dump(tmp_path / "shapes", iterations=(0,), run_id="run-a", pp=2, ranks={1})
    refused(run_cli(["vis", shapes, "--iteration", "0"]), "pp=2", case="dump two pp in one iteration")
    stray = make_dump(tmp_path / "stray", iterations=(0,))
    (dump_path(stray, 0, 0).parent / "rank_9.json").write_text("{}")
    refused(run_cli(["vis", stray, "--iteration", "0"]), "rank_9.json", case="dump stray file")


def test_two_runs_of_different_pp_in_one_folder(tmp_path):
    """An older pp=4 run and a newer pp=2 one share the folder: only the newest run is used, and the
    older one's iterations are named as skipped."""
    dump = make_dump(tmp_path / "d", iterations=(0, 1), run_id="old")
    make_dump(dump, iterations=(2,), run_id="new", pp=2, t0=5000.0)
    outcome = run_cli(["calibrate", dump, "--warmup", "0"])
    assert outcome.code == 0 and "skipped iteration 0" in outcome.err and "older run" in outcome.err, outcome.err
    assert "pp=4" in outcome.err


@pytest.mark.parametrize("name, make, names", [
    ("empty folder", lambda p: p.mkdir(), ["neither"]),
    ("not a timeline", lambda p: p.write_text(json.dumps({"format": "primuspipe.schedule", "version": 1})), ["timeline"]),
    ("missing", lambda p: None, ["does not exist", "dump directory"]),
    ("markup in the path", lambda p: None, ["[/x]"]),
])
def test_inputs_that_are_no_dump(tmp_path, name, make, names):
    path = tmp_path / ("[/x]" if "markup" in name else "input")
    make(path)
    refused(run_cli(["vis", path]), *names, case=f"vis {name}")


def test_outputs_are_checked_before_work(tmp_path):
    dump = make_dump(tmp_path / "d", iterations=(0,))
    (tmp_path / "file").write_text("x")
    for argv, names in [
        (["calibrate", dump, "-o", tmp_path], ["directory"]),
        (["calibrate", dump, "-o", tmp_path / "file" / "cost.yaml"], ["file is in the way"]),
        (["vis", dump, "--png", tmp_path], ["directory"]),
        (["vis", dump, "--html", tmp_path / "file" / "x.html"], ["file is in the way"]),
        (["simulate", "--algorithm", "1f1b", "--pp", "2", "-m", "2", "-o", tmp_path / "file"], ["not a directory"]),
        (["export", "1f1b", "--pp", "2", "-m", "2", "-o", tmp_path / "file" / "t.json"], ["file is in the way"]),
    ]:
        refused(run_cli(argv), *names, case=f"output {argv[0]} {argv[-1]}")


@settings(max_examples=25)
@given(st.sampled_from(["start", "end"]), st.one_of(
    st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
    st.sampled_from([True, None, "x", [], "1e999"])))
def test_generated_bad_times(tmp_path_factory, field, value):
    dump = make_dump(tmp_path_factory.mktemp("dump"), iterations=(0,))
    _edit(dump_path(dump, 0, 1), lambda d: d["ranks"][0]["events"][3].update({field: value}))
    refused(run_cli(["calibrate", dump]), field, case=f"dump {field}={value!r}")


@pytest.mark.skipif(not shutil.which("setpriv") and os.geteuid() == 0, reason="needs setpriv to drop root")
@pytest.mark.slow
def test_permission_denied_directory_is_named_so():
    """A dump directory that cannot be read is reported as such, not as "not a timeline" (run as an
    unprivileged user where the tests run as root, which reads everything)."""
    import tempfile

    root = tempfile.mkdtemp(prefix="primuspipe-denied-")
    try:
        os.chmod(root, 0o777)
        dump = make_dump(Path(root) / "d", iterations=(0,))
        (Path(root) / "mpl").mkdir()
        os.chmod(Path(root) / "mpl", 0o777)
        dump.chmod(0o000)
        code = "import sys; from primuspipe.cli import main; sys.exit(main(sys.argv[1:]))"
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MPLCONFIGDIR": f"{root}/mpl", "HOME": root}
        proc = subprocess.run([*prefix, sys.executable, "-c", code, "vis", str(dump)], capture_output=True, text=True,
                              env=env, timeout=60, cwd="/")
    finally:
        os.chmod(Path(root) / "d", 0o755)
        shutil.rmtree(root, ignore_errors=True)
    clear = proc.returncode != 0 and "Traceback" not in proc.stderr and "permission denied" in proc.stderr
    record("clear" if clear else "garbled", "vis permission denied")
    assert clear and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert str(dump) in proc.stderr
