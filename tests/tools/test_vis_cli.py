"""``primuspipe vis`` and ``primuspipe calibrate`` on a run dump and simulator output."""

import json
from dataclasses import replace

import pytest

from primuspipe.cli import build_parser, main
from primuspipe.algorithms.build import build_schedule
from primuspipe.simulator import CostModel, simulate
from primuspipe.io.timeline import Timeline, dump_path


@pytest.fixture
def dump_dir(write_dump):
    """Two iterations of a 1f1b pp=2 run (the first a slow warm-up), in seconds."""
    def step(f):
        return simulate(build_schedule("1f1b", pp=2, microbatches=4), CostModel.per_stage(2, f, 1.0, 1.0, time_unit="s"))

    return write_dump([replace(step(3.0).timeline(), source="run"), replace(step(1.0).timeline(), source="run")])


def test_help_explains_every_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("vis", "calibrate"):
        command = sub.choices[name]
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        assert "examples:" in command.format_help()


def test_calibrate_then_compare_the_run_with_its_simulation(dump_dir, tmp_path, capsys):
    cost = tmp_path / "measured.yaml"
    assert main(["calibrate", str(dump_dir), "-o", str(cost)]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "iterations 1" in out
    png, html, trace = tmp_path / "cmp.png", tmp_path / "cmp.html", tmp_path / "run.trace.json"
    assert main(["vis", str(dump_dir), "--cost", str(cost), "--png", str(png), "--html", str(html),
                 "--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["timeline"]["iteration"] == 1 and report["timeline"]["source"] == "run"
    figures = {f["name"]: f for f in report["comparison"]["figures"]}
    assert figures["step time"]["difference"] == pytest.approx(0.0, abs=1e-9)
    assert figures["F mean"]["run"] == pytest.approx(1.0) and figures["BW mean"]["simulated"] == pytest.approx(2.0)
    assert report["comparison"]["order_differences"] == []
    assert {p.name for p in tmp_path.iterdir()} >= {"cmp.png", "cmp.html", "run.trace.json", "run.trace.sim.json"}
    assert png.read_bytes()[:4] == b"\x89PNG" and "traceEvents" in json.loads(trace.read_text())
    # the human-readable form prints the side-by-side table
    assert main(["vis", str(dump_dir), "--cost", str(cost)]) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "identical on every rank" in out


def test_vis_against_a_simulated_timeline_file(dump_dir, tmp_path, capsys):
    assert main(["simulate", "-a", "gpipe", "--pp", "2", "-m", "4", "-o", str(tmp_path / "sim"), "--json"]) == 0
    capsys.readouterr()
    sim = tmp_path / "sim" / "gpipe.timeline.json"
    assert main(["vis", str(dump_dir), "--compare", str(sim), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["comparison"]["order_differences"], "1f1b run vs gpipe simulation: orders differ"
    assert main(["vis", str(dump_dir), "--compare", str(sim)]) == 0
    assert "1f1b vs gpipe" in capsys.readouterr().out  # the title named the run's algorithm alone
    assert main(["vis", str(sim)]) == 0
    assert "gpipe" in capsys.readouterr().out


def test_unreadable_input_is_a_clear_error(dump_dir, tmp_path, capsys):
    assert main(["vis", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "dump directory" in err and "--dump-dir" in err
    assert main(["vis", str(dump_dir), "--cost", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read cost model" in capsys.readouterr().err


def test_dumps_written_by_the_megatron_recorder_are_read(tmp_path):
    """The backend's own writer (StepRecorder, used under dump_pp_data) produces files pp_vis reads."""
    torch = pytest.importorskip("torch")
    from primuspipe.runtime.recorder import StepRecorder
    from primuspipe.tools.pp_vis import load_timeline, measure_costs

    table = build_schedule("1f1b", pp=2, microbatches=2)
    for rank, row in enumerate(table.ranks):
        recorder = StepRecorder(torch.device("cpu"))
        for i, node in enumerate(row):
            recorder.record(node, 0.5 * i, 0.5 * i + 0.5)
        recorder.timeline(table, rank, 0).save(dump_path(tmp_path, 0, rank))
    timeline = load_timeline(tmp_path)
    assert isinstance(timeline, Timeline) and [len(r.events) for r in timeline.ranks] == [len(r) for r in table.ranks]
    assert all(r.peak_memory_bytes > 0 for r in timeline.ranks)
    assert measure_costs([timeline]).forward == (0.5, 0.5)


@pytest.mark.parametrize("argv", [["-q", "calibrate"], ["calibrate", "-q"], ["calibrate", "--quiet"]])
def test_quiet_calibrate_prints_no_notes_but_still_its_errors(dump_dir, tmp_path, capsys, argv):
    """-q hides notes (here: the warm-up left nothing to skip, so every iteration was used), before or after
    the command name; the results and an error still show."""
    cost = tmp_path / "measured.yaml"
    assert main(["calibrate", str(dump_dir), "--warmup", "5", "-o", str(cost)]) == 0
    assert "note:" in capsys.readouterr().out, "the case has a note, so the check below can fail"
    assert main([*argv, str(dump_dir), "--warmup", "5", "-o", str(cost)]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "wrote" in out
    assert main([*argv, str(tmp_path / "nope")]) == 1
    assert "error:" in capsys.readouterr().err


def test_quiet_and_verbose_are_refused_together_on_either_side(capsys):
    for argv in (["-q", "calibrate", "-v", "x"], ["calibrate", "-q", "-v", "x"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
