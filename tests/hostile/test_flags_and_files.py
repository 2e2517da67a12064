"""Flags that only mean something together (offload's), inputs that are not regular files (a FIFO
blocked ``validate`` forever), and valid inputs near the edges that were refused: interleaved-1f1b at
vpp 1 (``list`` says any vpp), numpy integers as sizes. A multi-rank example prints a refusal once."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hostile_support import accepted, record, refused, run_api, run_cli
from primuspipe.algorithms.build import build_schedule

SIM = ["simulate", "-a", "1f1b", "--pp", "4", "-m", "8"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("extra, names", [
    (["--host-link", "0.01,2"], ["--host-link", "--offload"]),
    (["--host-link", "0,0"], ["--host-link", "--offload"]),
    (["--offload", "--memory-limit", "2", "--host-link", "0,0"], ["--host-link", "bandwidth"]),
    (["--offload", "--memory-limit", "2", "--host-link", "1"], ["--host-link", "LATENCY,BANDWIDTH"]),
    (["--offload", "--memory-limit", "2", "--host-link", "1,2,3"], ["--host-link"]),
    (["--offload", "--memory-limit", "2", "--host-link", "nan,1"], ["--host-link"]),
    (["--offload", "--memory-limit", "2", "--host-link", "1e20,1"], ["--host-link"]),
    (["--offload"], ["--memory-limit"]),
])
def test_simulate_offload_flags(extra, names):
    refused(run_cli([*SIM, *extra]), *names, case=f"simulate {' '.join(extra)}", before_work=True)


@pytest.mark.parametrize("command", ["show", "export"])
@pytest.mark.parametrize("extra, names", [
    (["--offload", "nan"], ["--offload"]), (["--offload", "inf"], ["--offload"]), (["--offload", "0"], ["--offload"]),
    (["--offload", "-1"], ["--offload"]), (["--offload", "２"], ["--offload"]), (["--cost", "c.yaml"], ["--offload"]),
])
def test_show_and_export_offload_flags(tmp_path, command, extra, names):
    argv = [command, "zb-h1", "--pp", "4", "-m", "8", *extra, *(["-o", tmp_path / "t.json"] if command == "export" else [])]
    refused(run_cli(argv, watch=tmp_path), *names, case=" ".join(map(str, argv[:1] + extra)))


EXAMPLES = ROOT / "examples" / "projection"


@pytest.mark.parametrize("argv, names", [
    (["project", "--model", EXAMPLES / "models" / "llama2-7b.yaml", "--hardware", EXAMPLES / "hardware" / "h100.yaml",
      "--benchmark-ranks", "4"], ["--benchmark-layers"]),
    (["vis", "TIMELINE", "--no-comm"], ["--png"]),
    (["validate", "TABLE", "--w-retained", "0.5"], ["--max-in-flight"]),
    (["validate", "TABLE", "--placement", "v"], ["placement"]),
])
def test_flags_that_need_another(tmp_path, argv, names):
    """A flag that only means something with another is refused alone, not silently ignored."""
    table = tmp_path / "t.json"
    assert run_cli(["export", "1f1b", "--pp", "2", "-m", "2", "-o", table]).code == 0
    assert run_cli(["simulate", "-a", "1f1b", "--pp", "2", "-m", "2", "-o", tmp_path / "sim"]).code == 0
    where = {"TABLE": table, "TIMELINE": tmp_path / "sim" / "1f1b.timeline.json"}
    argv = [where.get(a, a) for a in argv]
    refused(run_cli(argv), *names, case=" ".join(str(a) for a in argv if not isinstance(a, Path)))


@pytest.mark.parametrize("target", ["FIFO", "SOCKET"])
@pytest.mark.parametrize("flag", ["--png", "--trace", "-o"])
def test_outputs_that_are_pipes_or_sockets(tmp_path, fifo, target, flag):
    """Never renamed over (for a device node such as /dev/null that would replace the device): refused,
    naming the path. Only files this test made stand in for devices: code without the check would
    replace whatever the test names."""
    assert run_cli(["simulate", "-a", "1f1b", "--pp", "2", "-m", "2", "-o", tmp_path / "sim"]).code == 0
    if target == "SOCKET":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(tmp_path / "sock"))
        path = tmp_path / "sock"
    else:
        path = fifo
    argv = (["calibrate", tmp_path / "sim" / "1f1b.timeline.json", "-o", path] if flag == "-o" else
            ["vis", tmp_path / "sim" / "1f1b.timeline.json", flag, path])
    refused(run_cli(argv), "regular file", case=f"{argv[0]} {flag} {target}", before_work=True)
    assert not path.is_file()


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("argv", [
    ["validate", "FIFO"], ["vis", "FIFO"], ["calibrate", "FIFO"], ["simulate", *SIM[1:], "--cost", "FIFO"],
    ["project", "--model", "FIFO", "--hardware", "FIFO"], ["validate", "/dev/zero"], ["validate", "/dev/null"],
])  # inputs only: nothing here writes to a device
def test_inputs_that_are_no_regular_files(fifo, argv):
    argv = [fifo if a == "FIFO" else a for a in argv]
    refused(run_cli(argv), case=" ".join(map(str, argv)).replace(str(fifo), "FIFO"))


def test_interleaved_at_vpp_1_builds_as_list_says():
    for argv in (["show", "interleaved-1f1b", "--pp", "4", "-m", "8", "--vpp", "1"],
                 ["simulate", "-a", "interleaved-1f1b", "--pp", "4", "-m", "8", "--vpp", "1"]):
        accepted(run_cli(argv), case=" ".join(argv))


@pytest.mark.parametrize("kind", [np.int8, np.int16, np.int32, np.int64, np.uint32])
def test_numpy_integers_are_sizes(kind):
    table = build_schedule("1f1b", kind(4), kind(8))
    record("sound" if (table.pp, table.microbatches) == (4, 8) and type(table.pp) is int else "refused",
           f"build_schedule numpy {kind.__name__}")
    assert type(table.microbatches) is int


@pytest.mark.parametrize("value", [np.bool_(True), np.float64(4.0), np.float32(2.5), "4"])
def test_numpy_non_integers_are_not(value):
    refused(run_api(build_schedule, "1f1b", value, 8), "pp", case=f"build_schedule pp={value!r}")


@pytest.mark.slow
def test_example_prints_a_refusal_once_on_one_line(tmp_path):
    """train_torch.py under torchrun with a table the validator refuses: one line, from one rank."""
    bad = tmp_path / "t.txt"
    bad.write_text("Rank 0: (F|0|0),(B|0|0)\nRank 1: (F|0|0)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "train_torch.py"), "--pp", "2", "--schedule", str(bad)],
                          env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    # torchrun's agent reports a failed child in its own words; no rank's traceback may follow
    clear = done.returncode != 0 and len(lines) == 1 and "primuspipe.errors" not in done.stderr and \
        'train_torch.py", line' not in done.stderr
    record("clear" if clear else "garbled", "train_torch.py refused table under torchrun")
    assert clear, done.stderr[-3000:]
