"""Outputs and the order of work: an output never destroys an input or another output, every output path
is checked before any work, a failed write leaves nothing behind and names the user's path, and ``-o -``
is standard output wherever one file is written."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import accepted, make_dump, refused, run_cli


from primuspipe.io.timeline import dump_path

SIM = ["simulate", "--algorithm", "1f1b", "--pp", "2", "-m", "2"]


@pytest.fixture
def timeline(tmp_path):
    assert run_cli([*SIM, "-o", tmp_path / "sim"]).code == 0
    return tmp_path / "sim" / "1f1b.timeline.json"


OUTPUT_FLAGS = ["--png", "--html", "--trace"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(OUTPUT_FLAGS), min_size=2, max_size=3, unique=True),
       st.sampled_from(["x", "./x", "sub/../x", "x.out", "LINK"]))  # not x.json: a PNG there is refused for its name
def test_two_outputs_on_one_path(tmp_path_factory, flags, name):
    """Any two outputs of one command named the same file, however spelt (relative, '..', a link)."""
    tmp = tmp_path_factory.mktemp("collide")
    assert run_cli([*SIM, "-o", tmp / "sim"]).code == 0
    source = tmp / "sim" / "1f1b.timeline.json"
    (tmp / "sub").mkdir()
    os.chdir(tmp)
    first, *rest = flags
    other = name
    if name == "LINK":
        name, other = "target.out", "link.out"
        (tmp / "link.out").symlink_to(tmp / "target.out")
    argv = ["vis", source, first, name, *[x for flag in rest for x in (flag, other)]]
    refused(run_cli(argv, watch=tmp), "same file", case=f"vis {' '.join(map(str, argv[2:]))}", before_work=True)


@pytest.mark.parametrize("how", ["same", "relative", "hardlink", "symlink"])
@pytest.mark.parametrize("flag", OUTPUT_FLAGS)
def test_output_over_the_input(timeline, flag, how):
    os.chdir(timeline.parent)
    target = {"same": timeline, "relative": f"../sim/{timeline.name}"}.get(how)
    if how == "hardlink":
        target = timeline.parent / "hard.json"
        os.link(timeline, target)
    if how == "symlink":
        target = timeline.parent / "soft.json"
        target.symlink_to(timeline)
    before = timeline.read_bytes()
    refused(run_cli(["vis", timeline, flag, target]), "input", case=f"vis {flag} over its input ({how})",
            before_work=True)
    assert timeline.read_bytes() == before


@pytest.mark.parametrize("inside", ["iter_000000/rank_0.json", "iter_000001/rank_1.json", "cost.yaml"])
def test_calibrate_writing_into_its_dump(tmp_path, inside):
    dump = make_dump(tmp_path / "d")
    before = dump_path(dump, 0, 0).read_bytes()
    refused(run_cli(["calibrate", dump, "-o", dump / inside], watch=dump), "input",
            case=f"calibrate -o inside its dump ({inside})", before_work=True)
    assert dump_path(dump, 0, 0).read_bytes() == before


def test_vis_compare_and_cost_are_inputs_too(tmp_path, timeline):
    cost = tmp_path / "cost.yaml"
    cost.write_text("compute: {f: 1, b: 1, w: 1}\n")
    for argv in (["vis", timeline, "--cost", cost, "--png", cost], ["vis", timeline, "--compare", timeline,
                                                                     "--html", timeline]):
        refused(run_cli(argv), "input", case=" ".join(map(str, argv[2:])), before_work=True)


def test_simulate_outputs_over_its_cost_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cost = out / "1f1b.trace.json"
    cost.write_text("compute: {f: 1, b: 1, w: 1}\n")
    refused(run_cli([*SIM, "--cost", cost, "-o", out]), "input", case="simulate -o over its --cost", before_work=True)


@pytest.mark.parametrize("blocked", ["--html", "--trace", "--trace-sim"])
def test_a_bad_path_among_several_leaves_nothing(tmp_path, timeline, blocked):
    """One output path that cannot be written (a directory there): refused before drawing, nothing left."""
    out = tmp_path / "out"
    out.mkdir()
    paths = {"--png": out / "a.png", "--html": out / "a.html", "--trace": out / "a.json"}
    (out / "a.sim.json" if blocked == "--trace-sim" else paths[blocked]).mkdir()
    argv = ["vis", timeline, "--cost", _unit_cost(tmp_path), *[x for kv in paths.items() for x in kv]]
    refused(run_cli(argv, watch=out), "directory", case=f"vis outputs with {blocked} a directory", before_work=True)


def _unit_cost(tmp_path):
    cost = tmp_path / "unit.yaml"
    cost.write_text("compute: {f: 0.01, b: 0.01, w: 0.01}\n")
    return cost


@pytest.mark.parametrize("blocked", ["1f1b.timeline.json", "gpipe.trace.json", "zbv.timeline.json"])
def test_simulate_per_algorithm_output_that_is_a_directory(tmp_path, blocked):
    out = tmp_path / "out"
    (out / blocked).mkdir(parents=True)
    refused(run_cli(["simulate", "-a", "all", "--pp", "2", "-m", "4", "-o", out], watch=out), blocked,
            case=f"simulate -o with {blocked} a directory", before_work=True)


def test_export_sidecar_that_is_a_directory(tmp_path):
    (tmp_path / "t.csv.meta.json").mkdir()
    refused(run_cli(["export", "1f1b", "--pp", "2", "-m", "2", "--format", "csv", "-o", tmp_path / "t.csv"],
                    watch=tmp_path), "sidecar", case="export csv sidecar a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_folder_is_named_not_a_temp_file(tmp_path, timeline):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        outcome = refused(run_cli(["vis", timeline, "--png", out / "a.png"]), "a.png", case="vis --png read-only")
    finally:
        out.chmod(0o700)
    assert ".part" not in outcome.message and ".tmp" not in outcome.message


def test_failed_write_names_the_users_path_and_leaves_nothing(tmp_path, timeline, monkeypatch):
    """A write that fails midway (a full disk): one line naming the output, no temporary file left."""
    from primuspipe.tools.pp_vis import html

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(html, "write_html", full_disk)
    out = tmp_path / "out"
    out.mkdir()
    outcome = refused(run_cli(["vis", timeline, "--png", out / "a.png", "--html", out / "a.html"], watch=out),
                      "a.html", "No space", case="vis write fails midway")
    assert ".part" not in outcome.message and not list(out.iterdir())


@pytest.mark.parametrize("argv", [
    ["export", "1f1b", "--pp", "2", "-m", "2", "-o", "-"],
    ["export", "1f1b", "--pp", "2", "-m", "2", "--format", "csv", "-o", "-"],
    ["calibrate", "DUMP", "-o", "-"],
])
def test_dash_is_stdout_everywhere(tmp_path, argv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dump = make_dump(tmp_path / "d")
    outcome = accepted(run_cli([dump if a == "DUMP" else a for a in argv]), case=" ".join(argv))
    assert outcome.out and not (tmp_path / "-").exists()


def test_json_outputs_list_what_was_written(tmp_path, timeline):
    outcome = accepted(run_cli(["vis", timeline, "--png", tmp_path / "a.png", "--json"]), case="vis --png --json")
    assert json.loads(outcome.out)["written"] == [str(tmp_path / "a.png")]
