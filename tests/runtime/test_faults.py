"""Real runs broken on purpose (CPU, gloo, pp=4): one rank is SIGKILLed or SIGSTOPped mid-training.
Every surviving rank must exit non-zero within the watchdog timeout + 10 s with a message naming the
dead or stopped rank -- the cause, not the neighbour it waited on (rank 0 waits on rank 1, which waits
on rank 2: rank 0 names rank 2). Launched two ways: four processes of our own (nobody stops the
survivors: each must find out itself) and torchrun (which stops every rank once one failed)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).parents[1] / "support" / "fault_worker.py"
TIMEOUT_S = 4.0
PP, FAULTY = 4, 2


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", **extra}


def _names_the_faulty_rank(message: str) -> bool:
    cause = message.split("Not responding (dead or stopped):", 1)
    return len(cause) == 2 and f"pipeline rank {FAULTY} (" in cause[1] and \
        not any(f"pipeline rank {r} (" in cause[1] for r in range(PP) if r != FAULTY)


def _cleanup(out: Path) -> None:
    for pid_file in out.glob("pid_*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # a stopped rank stays until killed
        except (ProcessLookupError, ValueError):
            pass


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["KILL", "STOP"])
def test_own_launcher(tmp_path, fault):
    out = tmp_path / "out"
    out.mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), fault, str(TIMEOUT_S)], stderr=subprocess.PIPE,
                              text=True, env=_env(RANK=str(r), WORLD_SIZE=str(PP), FAULT_STORE=str(tmp_path / "store")))
             for r in range(PP)]
    try:
        ended = {}
        deadline = time.monotonic() + 120
        while len(ended) < PP - 1 and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r != FAULTY and r not in ended and p.poll() is not None:
                    ended[r] = time.time()
            time.sleep(0.05)
        fault_time = float((out / "fault_time").read_text())
    finally:
        _cleanup(out)
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        err = p.communicate(timeout=30)[1]
        if r == FAULTY:
            continue
        assert r in ended, f"rank {r} still ran 120 s after rank {FAULTY} was sent SIG{fault}: {err}"
        assert p.returncode != 0, f"rank {r} exited 0"
        assert ended[r] - fault_time < TIMEOUT_S + 10, f"rank {r} took {ended[r] - fault_time:.1f} s"
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert _names_the_faulty_rank(lines[0]), f"rank {r} does not name rank {FAULTY} (alone) as the cause: {lines[0]}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="needs torchrun")
@pytest.mark.parametrize("fault", ["KILL", "STOP"])
def test_torchrun(tmp_path, fault):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    torchrun = str(Path(sys.executable).parent / "torchrun") if (Path(sys.executable).parent / "torchrun").exists() \
        else "torchrun"
    start = time.time()
    proc = subprocess.Popen([torchrun, "--standalone", f"--nproc-per-node={PP}", "--log-dir", str(logs), "--redirects",
                             "3", "--monitor-interval", "0.1", str(WORKER), str(out), fault, str(TIMEOUT_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=tmp_path)
    try:
        launcher_output = proc.communicate(timeout=120)[0]
    finally:
        _cleanup(out)
        if proc.poll() is None:
            proc.kill()
    fault_time = float((out / "fault_time").read_text())
    assert proc.returncode != 0
    assert time.time() - fault_time < TIMEOUT_S + 10 + 5, "torchrun itself ended well after the survivors"
    for r in range(PP):
        if r == FAULTY:
            continue
        (err_file,) = logs.rglob(f"attempt_0/{r}/stderr.log")
        err = err_file.read_text()
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith(("error: ", "pipeline rank "))]
        assert lines and _names_the_faulty_rank(lines[-1]), \
            f"rank {r} does not name rank {FAULTY} as the cause:\n{err}\n{launcher_output[-2000:]}"
