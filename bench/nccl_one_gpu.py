"""Real NCCL with several ranks on ONE GPU, and the NCCL emulator's verdicts beside it.

NCCL refuses two ranks on one device ("Duplicate GPU detected": same host hash and bus id). Each rank here is
told it is its own host (``NCCL_HOSTID``), so NCCL accepts them and connects them over loopback sockets (its
network transport: no P2P or shared-memory path between "hosts"). Its p2p kernels keep NCCL's semantics: a send
runs as a kernel on the communicator's stream and finishes only as the peer's receive takes the data, operations
on one stream run in order, and ``ProcessGroupNCCL`` keys the streams as on a real cluster (unbatched send/recv:
one communicator per rank pair with lazy init, torch's default; the group's one communicator when the process
group is bound to a device, eager init). The GPU time-slices the ranks' contexts, so one rank's spinning kernel
does not stop the others. What can differ from NVLink: how much a send may buffer before its peer receives
(the socket transport's staging), which is why every pattern runs with a small and a large message.

    python bench/nccl_one_gpu.py patterns [--modes nccl-lazy nccl-eager pair group gloo] [--sizes small large] [-o FILE]
    python bench/nccl_one_gpu.py train --ranks 2 [--deadline 120] -- examples/train_gpt.py --pp 2 ...

``patterns``: each communication pattern below, on every transport asked for (``nccl-lazy`` / ``nccl-eager``:
real NCCL on the local GPU; ``pair`` / ``group``: the emulator on CPU; ``gloo``: plain gloo), with a deadline:
a pattern that has not finished by then is a hang. The JSON has each verdict and whether the emulator's
agree with NCCL's (``pair`` with ``nccl-lazy``, ``group`` with ``nccl-eager``). ``train``: launches the given
script as ``--ranks`` ranks on the one GPU (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and a distinct
``NCCL_HOSTID`` each), prints its last output line and exits with its status (124 past the deadline).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = {
    "ordered": "rank 0 sends then receives, rank 1 receives then sends (a correct exchange)",
    "send_first": "both ranks send, then receive (blocking send/recv, unbatched)",
    "isend_first": "both post isend, then irecv, then wait for both (unbatched)",
    "batched": "both post isend and irecv in one batch_isend_irecv",
    "ring3_send_first": "three ranks, each sends to the next, then receives from the previous (unbatched)",
    "ring3_warm_send_first": "as ring3_send_first after one correct exchange on every rank pair (every pair's "
                             "communicator already made)",
    "ring3_warm_isend_first": "after the same warm-up, each posts isend to the next and irecv from the previous, "
                              "then waits for both (unbatched: apart on pair streams, in line on one group stream)",
}
SIZES = {"small": 1024, "large": 16 * 1024 * 1024}  # float32 elements: 4 KiB, 64 MiB
TRANSPORTS = ("nccl-lazy", "nccl-eager", "pair", "group", "gloo")
AGREE = {"pair": "nccl-lazy", "group": "nccl-eager"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environments(ranks: int, transport: str) -> list[dict]:
    """One environment per rank of a local launch; real NCCL ranks each get their own ``NCCL_HOSTID``."""
    port = _free_port()
    out = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        env.pop("PRIMUSPIPE_NCCL_EMULATION", None)
        if transport.startswith("nccl"):
            env.update(NCCL_HOSTID=f"primuspipe-rank-{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
        elif transport in ("pair", "group"):
            env["PRIMUSPIPE_NCCL_EMULATION"] = transport
        out.append(env)
    return out


def launch(command: list[str], ranks: int, transport: str, deadline: float, *, ready: bool = False,
           startup: float = 180.0) -> dict:
    """Run ``command`` as ``ranks`` local ranks; ``outcome``: ok, hang or error. ``ready``: every rank prints
    ``ready`` once its process group is up (a pattern's worker), and the clock starts then: the run hangs when it
    has not ended ``deadline`` seconds after every rank was ready (so slow starts on a busy host are not hangs),
    and is an error past ``startup`` seconds without every rank ready (never started); otherwise ``deadline``
    counts from the start."""
    started = time.monotonic()
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(ranks)]  # never a full pipe
    procs = [subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=err, text=True, start_new_session=True)
             for env, (out, err) in zip(rank_environments(ranks, transport), logs)]
    ready_at = None if ready else started
    outcome = "ok"
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if ready_at is None:
            if all(_printed(out, "ready") for out, _ in logs):
                ready_at = now
            elif now - started > startup or any(p.returncode for p in procs if p.poll() is not None):
                outcome = "error"
        elif now - ready_at > deadline:
            outcome = "hang"
        if outcome != "ok":
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    outputs = []
    for out, err in logs:
        out.seek(0), err.seek(0)
        outputs.append((out.read(), err.read()))
    if outcome == "ok" and any(p.returncode for p in procs):
        outcome = "error"
    return {"outcome": outcome, "seconds": round(time.monotonic() - started, 1),
            "seconds_after_ready": None if ready_at is None else round(time.monotonic() - ready_at, 1),
            "returncodes": [p.returncode for p in procs],
            "stdout_tail": [o[0].strip().splitlines()[-1:] for o in outputs],
            "stderr_tail": [o[1][-600:] for o in outputs] if outcome == "error" else []}


def _printed(log, word: str) -> bool:
    log.seek(0)
    return word in log.read().split()


def worker(pattern: str, size: str, transport: str) -> None:
    """One rank of ``pattern`` (run by ``launch``; the verdict is whether every rank gets to the end)."""
    import torch
    import torch.distributed as dist

    from primuspipe.runtime import nccl_emulation

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if transport.startswith("nccl"):
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        bound = {"device_id": device} if transport == "nccl-eager" else {}
        dist.init_process_group("nccl", **bound)
    else:
        device = torch.device("cpu")
        dist.init_process_group(nccl_emulation.cpu_backend() if transport != "gloo" else "gloo")
    print("ready", flush=True)  # the launcher's clock for the deadline starts when every rank is here
    out = torch.full((SIZES[size],), float(rank), device=device)
    into = torch.empty_like(out)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    if pattern == "ordered":
        if rank == 0:
            dist.send(out, 1), dist.recv(into, 1)
        else:
            dist.recv(into, 0), dist.send(out, 0)
    elif pattern.startswith("ring3_warm"):
        for low, high in ((0, 1), (1, 2), (0, 2)):  # one global order: lazy init of each pair cannot cycle
            if rank in (low, high):
                peer = high if rank == low else low
                if rank == low:
                    dist.send(out, peer), dist.recv(into, peer)
                else:
                    dist.recv(into, peer), dist.send(out, peer)
        if pattern == "ring3_warm_send_first":
            dist.send(out, nxt)
            dist.recv(into, prev)
        else:
            sent, got = dist.isend(out, nxt), dist.irecv(into, prev)
            sent.wait(), got.wait()
    elif pattern in ("send_first", "ring3_send_first"):
        dist.send(out, nxt)
        dist.recv(into, prev)
    elif pattern == "isend_first":
        sent = dist.isend(out, nxt)
        got = dist.irecv(into, prev)
        sent.wait(), got.wait()
    elif pattern == "batched":
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, into, prev)]):
            work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert float(into[0]) == float(prev), (float(into[0]), prev)  # the data arrived, from the right rank
    print("done", flush=True)
    os._exit(0)  # a hung peer's communicator must not hold this rank in NCCL's teardown


def patterns(transports: list[str], chosen: list[str], sizes: list[str], deadline: float, parallel: int,
             output: Path | None, earlier: Path | None) -> None:
    """Every pattern at every size asked for on every transport, ``parallel`` launches at a time; ``earlier``: a
    JSON of this command (e.g. the emulator's verdicts from a CPU host) whose transports join the rows before
    agreement."""
    cases = [(p, size, t) for p in chosen for size in sizes for t in transports]

    def run(case):
        pattern, size, transport = case
        result = launch([sys.executable, __file__, "worker", pattern, size, transport],
                        3 if pattern.startswith("ring3") else 2, transport, deadline, ready=True)
        print(f"{pattern:22s} {size:5s} {transport:10s} {result['outcome']:5s} {result['seconds']:6.1f} s",
              file=sys.stderr, flush=True)
        return result

    with ThreadPoolExecutor(parallel) as pool:
        results = dict(zip(cases, pool.map(run, cases)))
    before = {(r["pattern"], r["size"]): r for r in json.loads(earlier.read_text())["rows"]} if earlier else {}
    rows = []
    for pattern in chosen:
        for size in sizes:
            row = {"pattern": pattern, "size": size, "what": PATTERNS[pattern]}
            row.update({t: v for t, v in before.get((pattern, size), {}).items() if t in TRANSPORTS})
            row.update({t: results[pattern, size, t] for t in transports})
            row["emulator_agrees"] = {emu: row[emu]["outcome"] == row[real]["outcome"]
                                      for emu, real in AGREE.items() if emu in row and real in row}
            rows.append(row)
    transports = [t for t in TRANSPORTS if any(t in r for r in rows)]
    payload = {"deadline_s": deadline, "sizes_bytes": {k: 4 * v for k, v in SIZES.items()}, "rows": rows}
    try:
        import torch

        payload.update(torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version()))
                       if torch.cuda.is_available() else None,
                       gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    except Exception as error:  # the versions are a label; their absence must not lose the verdicts
        payload["versions_error"] = str(error)
    text = json.dumps(payload, indent=1)
    if output:
        output.write_text(text)
    for row in rows:
        verdicts = "  ".join(f"{t}={row[t]['outcome']}" for t in transports)
        print(f"{row['pattern']:22s} {row['size']:5s} {verdicts}  agree={row['emulator_agrees']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("patterns", help="every pattern on every transport asked for")
    p.add_argument("--modes", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    p.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS))
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES),
                   help="message sizes (the emulator's test holds NCCL's verdicts at the large one only)")
    p.add_argument("--deadline", type=float, default=20.0,
                   help="seconds after every rank is ready before a pattern counts as a hang")
    p.add_argument("--parallel", type=int, default=1, help="launches at a time")
    p.add_argument("--with", dest="earlier", type=Path, help="join the verdicts of an earlier run of this command")
    p.add_argument("-o", "--output", type=Path)
    t = sub.add_parser("train", help="launch a training script as --ranks ranks on the one GPU")
    t.add_argument("--ranks", type=int, required=True)
    t.add_argument("--deadline", type=float, default=300.0)
    t.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    w = sub.add_parser("worker")
    w.add_argument("pattern", choices=PATTERNS)
    w.add_argument("size", choices=SIZES)
    w.add_argument("transport", choices=TRANSPORTS)
    args = parser.parse_args()
    if args.command == "worker":
        worker(args.pattern, args.size, args.transport)
    elif args.command == "patterns":
        patterns(args.modes, args.patterns, args.sizes, args.deadline, args.parallel, args.output, args.earlier)
    else:
        script = args.script[1:] if args.script[:1] == ["--"] else args.script
        result = launch([sys.executable, *script], args.ranks, "nccl-lazy", args.deadline)
        print(json.dumps({k: v for k, v in result.items() if k != "stdout_tail"}))
        for tail in reversed(result["stdout_tail"]):  # rank 0's line (the example's JSON) last
            print(*tail)
        sys.exit({"ok": 0, "hang": 124}.get(result["outcome"], 1))


if __name__ == "__main__":
    main()
