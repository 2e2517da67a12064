import json
import subprocess
import sys
from pathlib import Path

import pytest

from primuspipe.algorithms import get_algorithm, list_algorithms, register, registry
from primuspipe.cli import main
from primuspipe.errors import ConfigError, DuplicateAlgorithmError, PrimusPipeError, UnknownAlgorithmError
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.table import ScheduleTable


def test_duplicate_names_are_rejected(clean_registry):
    with pytest.raises(DuplicateAlgorithmError, match="'1f1b' is already registered"):
        register("1f1b")(lambda req: None)


def test_unknown_algorithm_lists_the_registered_ones():
    with pytest.raises(UnknownAlgorithmError, match="registered: .*1f1b"):
        get_algorithm("nope")


def test_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match="microbatch_group_size"):
        build_schedule("interleaved-1f1b", 2, 4, 2, group=3)


def _make_plugin(tmp_path: Path, module: str, module_body: str) -> None:
    (tmp_path / f"{module}.py").write_text(module_body)
    dist = tmp_path / "myplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[primuspipe.algorithms]\nreverse-gpipe = {module}\n")


def test_entry_point_plugins_are_loaded(clean_registry, tmp_path, monkeypatch):
    _make_plugin(tmp_path, "myplug_good", (
        "from primuspipe.algorithms import register\n"
        "from primuspipe.ir.node import F, BW\n"
        "from primuspipe.ir.placement import Placement\n"
        "from primuspipe.ir.table import ScheduleTable\n"
        "@register('reverse-gpipe', vpp=1)\n"
        "def reverse_gpipe(req):\n"
        "    '''GPipe with backwards in reverse microbatch order.'''\n"
        "    m = req.microbatches\n"
        "    rows = [[F(i) for i in range(m)] + [BW(i) for i in reversed(range(m))] for _ in range(req.pp)]\n"
        "    return ScheduleTable.build(Placement.interleaved(req.pp), m, rows, 'reverse-gpipe')\n"
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._plugins_loaded = False
    assert "reverse-gpipe" in [a.name for a in list_algorithms()]
    table = build_schedule("reverse-gpipe", 3, 4)
    assert str(table.compute_only().ranks[2][4]) == "BW3.0"


def test_broken_plugin_names_itself(clean_registry, tmp_path, monkeypatch):
    _make_plugin(tmp_path, "myplug_broken", "raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._plugins_loaded = False
    with pytest.raises(PrimusPipeError, match="plug-in 'reverse-gpipe' .*boom"):
        list_algorithms()


def test_cli_list_show_export_validate(tmp_path, capsys):
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "interleaved-1f1b" in listing and "microbatch_group_size" in listing
    assert main(["show", "1f1b", "--pp", "2", "-m", "3", "--compute-only"]) == 0
    shown = capsys.readouterr().out
    assert "rank  1 | F0.0" in shown and "SEND" not in shown
    js = tmp_path / "t.json"
    assert main(["export", "interleaved-1f1b", "--pp", "2", "--vpp", "2", "-m", "4", "-o", str(js)]) == 0
    table = ScheduleTable.from_json(js.read_text())
    assert (table.pp, table.vpp, table.microbatches, table.has_communication) == (2, 2, 4, True)
    assert main(["validate", str(js)]) == 0
    assert "valid:" in capsys.readouterr().out
    csv_path = tmp_path / "t.csv"
    assert main(["export", "1f1b", "--pp", "3", "-m", "5", "--format", "csv", "--compute-only", "-o", str(csv_path)]) == 0
    assert "SEND" not in csv_path.read_text()
    assert main(["validate", str(csv_path)]) == 0


def test_cli_validate_rejects_a_broken_table(tmp_path, capsys):
    data = build_schedule("1f1b", 2, 2).to_dict()
    data["ranks"][0] = [n for n in data["ranks"][0] if n != "BW1.0"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out and "[completeness]" in out and "fix:" in out


def test_cli_errors_exit_1_with_the_message(capsys):
    assert main(["show", "1f1b", "--pp", "2", "--vpp", "2", "-m", "4"]) == 1
    err = capsys.readouterr().err
    assert "1f1b needs vpp = 1" in err and "give vpp 1" in err, err
    assert "an algorithm that runs vpp 2: " in err and "interleaved-1f1b" in err and "zb-h1" not in err, err
    assert main(["show", "interleaved-1f1b", "--pp", "4", "--vpp", "2", "-m", "5", "-O", "microbatch_group_size=4"]) == 1
    assert "last group would hold 1" in capsys.readouterr().err


def test_installed_console_script_runs():
    exe = Path(sys.executable).with_name("primuspipe")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True).stdout
    assert "validate" in out and "export" in out
    shown = subprocess.run([str(exe), "show", "gpipe", "--pp", "2", "-m", "2"], capture_output=True, text=True, check=True).stdout
    assert "gpipe: pp=2 vpp=1 microbatches=2" in shown


@pytest.mark.parametrize("algorithm", ["zb-auto", "v-min", "zb-h1", "1f1b"])
def test_show_and_export_keep_to_the_memory_limit_or_refuse(algorithm, tmp_path, capsys):
    """--memory-limit reaches cost-aware algorithms (they plan within it); a table still over it is refused
    by both commands, naming the rank and its peak, and nothing is written (-O memory_limit=... is refused
    since round ten of the hostile sweep, so the flag is the one way to give the budget)."""
    from primuspipe.ir.activations import peak_in_flight

    unlimited = max(peak_in_flight(build_schedule(algorithm, 4, 8)))
    limited = build_schedule(algorithm, 4, 8, memory_limit=3)
    out = tmp_path / "t.json"
    code = main(["export", algorithm, "--pp", "4", "-m", "8", "--memory-limit", "3", "-o", str(out)])
    shown = main(["show", algorithm, "--pp", "4", "-m", "8", "--memory-limit", "3"])
    captured = capsys.readouterr()
    if max(peak_in_flight(limited)) <= 3:
        assert code == shown == 0 and ScheduleTable.from_json(out.read_text()) == limited
        assert algorithm in ("zb-auto", "v-min") or unlimited <= 3
    else:
        assert code == shown == 1 and not out.exists()
        assert captured.err.count("over --memory-limit 3") == 2 and "on rank 0" in captured.err


def test_progress_prints_once_on_stderr_when_a_library_configured_the_root_logger(capsys):
    """megatron.training's import calls logging.basicConfig with a standard-output handler; the command's
    progress must not print a second time there (inside --json output)."""
    import logging

    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)  # what basicConfig gives, as megatron.training configures it
    root.addHandler(handler)
    try:
        assert main(["show", "zb-auto", "--pp", "2", "-m", "4", "--compute-only"]) == 0
    finally:
        root.removeHandler(handler)
    captured = capsys.readouterr()
    assert captured.err.count("zb-auto: searching interleaved vpp=1") == 1
    assert "searching" not in captured.out and "rank  0 |" in captured.out
