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
        print(f"SIG{fault} rank {r} after {ended[r] - fault_time:.1f} s, status {p.returncode}: {lines}")
        assert len(lines) == 1 and "Traceback" not in err, err
        assert _names_the_faulty_rank(lines[0]), f"rank {r} does not name rank {FAULTY} (alone) as the cause: {lines[0]}"


def _torchrun() -> str | None:
    beside = Path(sys.executable).parent / "torchrun"
    return str(beside) if beside.exists() else shutil.which("torchrun")


def _report_lines(logs: Path, rank: int) -> list[str]:
    found = list(logs.rglob(f"attempt_0/{rank}/stderr.log"))
    text = found[0].read_text() if found else ""
    return [line for line in text.splitlines() if line.startswith(("error: ", "pipeline rank "))]


@pytest.mark.slow
@pytest.mark.skipif(_torchrun() is None, reason="needs torchrun")
@pytest.mark.parametrize("fault", ["KILL", "STOP"])
def test_torchrun(tmp_path, fault):
    """torchrun stops the others once one rank failed (SIGTERM): each survivor's last words, its own error
    or the SIGTERM report, name rank 2. A stopped rank 2 cannot take SIGTERM; it is killed once the
    survivors have spoken, as torchrun itself would after its grace period."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    proc = subprocess.Popen([_torchrun(), "--standalone", f"--nproc-per-node={PP}", "--log-dir", str(logs), "--redirects",
                             "3", "--monitor-interval", "0.1", str(WORKER), str(out), fault, str(TIMEOUT_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=tmp_path)
    survivors = [r for r in range(PP) if r != FAULTY]
    spoke: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 120
        while len(spoke) < len(survivors) and time.monotonic() < deadline and proc.poll() is None:
            for r in survivors:
                if r not in spoke and _report_lines(logs, r):
                    spoke[r] = time.time()
            time.sleep(0.05)
        faulty_pid = out / f"pid_{FAULTY}"
        if faulty_pid.exists():
            try:
                os.kill(int(faulty_pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher_output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        _cleanup(out)
    fault_time = float((out / "fault_time").read_text())
    assert proc.returncode != 0, launcher_output[-2000:]
    for r in survivors:
        lines = _report_lines(logs, r)
        print(f"torchrun SIG{fault} rank {r} after {spoke.get(r, time.time()) - fault_time:.1f} s: {lines}")
        assert lines and _names_the_faulty_rank(lines[-1]), \
            f"rank {r} does not name rank {FAULTY} as the cause: {lines}\n{launcher_output[-3000:]}"
        assert spoke.get(r, time.time()) - fault_time < TIMEOUT_S + 10, f"rank {r} spoke late"
        text = next(logs.rglob(f"attempt_0/{r}/stderr.log")).read_text()
        assert "Traceback" not in text, text
