"""The console entry point as a user meets it, in a real process: bad input ends with one plain-text
line on stderr and a non-zero status, never a traceback, and writes nothing."""

import os
import subprocess
import sys

import pytest

from hostile_support import record

CODE = "import sys; from primuspipe.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("argv, status, names", [
    (["simulate", "--algorithm", "1f1b", "--pp", "4", "-m", "8", "--f", "inf"], 2, ["--f", "finite"]),
    (["validate", "missing [/x].json"], 1, ["missing [/x].json", "does not exist"]),
    (["export", "1f1b", "--pp", "4", "-m", "1000000000", "-o", "out.json"], 1, ["nodes"]),
    (["simulate", "--algorithm", "[/x]", "--pp", "2", "-m", "2"], 1, ["[/x]"]),
])
def test_one_line_no_traceback(tmp_path, argv, status, names):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", CODE, *argv], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if "error: " in line]
    lines += [line for line in proc.stdout.splitlines() if line.startswith("INVALID ")]  # validate's answer
    clear = proc.returncode == status and "Traceback" not in proc.stderr and len(lines) == 1
    record("clear" if clear else "garbled", " ".join(argv))
    assert clear, proc.stderr
    for name in names:
        assert name in lines[0]
    assert not list(tmp_path.iterdir()), "nothing written"


def test_python_m_primuspipe_is_the_command(tmp_path):
    """``python -m primuspipe`` runs the console script (it was "No module named primuspipe.__main__"): a
    user whose virtual environment is not activated, or who runs a checkout on ``PYTHONPATH``, has no
    ``primuspipe`` on ``PATH``. Its exit status and its error line are the command's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = [sys.executable, "-m", "primuspipe"]
    shown = subprocess.run([*run, "show", "1f1b", "--pp", "2", "-m", "2", "--compute-only"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("1f1b: pp=2 vpp=1 microbatches=2")
    helped = subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: primuspipe "), helped.stdout
    refused = subprocess.run([*run, "show", "zbx", "--pp", "2", "-m", "2"], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=120)
    assert refused.returncode == 1 and refused.stderr.startswith("error: no algorithm named 'zbx'"), refused.stderr


@pytest.mark.parametrize("argv", [
    ["simulate", "--algorithm", "all", "--pp", "4", "-m", "8", "--json"],
    ["show", "zbv", "--pp", "4", "-m", "8"],
])
def test_a_reader_that_goes_away_is_no_error(tmp_path, argv):
    """``primuspipe simulate --json | head -1``: once the reader has closed the pipe, what is left to print
    goes nowhere, with no ``error:`` line (it was "error: cannot access: Broken pipe") and no traceback at
    exit's flush; the status says the output was cut (1)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", CODE, *argv, "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path, env=env, text=True)
    proc.stdout.close()  # the reader is gone before the first line
    stderr = proc.stderr.read()
    status = proc.wait(timeout=120)
    quiet = status == 1 and "error" not in stderr and "Traceback" not in stderr and "Exception ignored" not in stderr
    record("clear" if quiet else "garbled", "closed stdout: " + " ".join(argv))
    assert quiet, (status, stderr)
