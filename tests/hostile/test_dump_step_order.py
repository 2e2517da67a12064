"""Run dumps (``pp_data`` folders) that ``calibrate`` and ``vis`` read, damaged in ways earlier rounds did not
generate: a microbatch's backward recorded before its forward, or its W before its B, on each rank of a fused-
backward (1F1B) and a split-backward (ZB-H1) run; and each rank file truncated at a byte fraction, in the only
iteration (refused naming the file) and in one of several (skipped, the warning naming the file).

Defects this family found: a backward named before its forward was drawn by ``vis`` as it stood, and ``calibrate``
read it as a table that deadlocks ("cannot complete under the primuspipe transport semantics"), naming no file,
rank or node (``Timeline.check_one_step`` now checks each microbatch's steps run in order on its rank)."""

import json

import pytest

from hostile_support import PP, make_dump, not_valid_afterwards, record, refused, run_cli
from primuspipe.io.timeline import dump_path


def _computes(events):
    return [e for e in events if "_" not in e["node"]]


def _swap(first: str, then: tuple[str, ...], mb: int):
    """Swap the names of microbatch ``mb``'s ``first`` step and the event of ``then`` after it (same rank, chunk 0):
    the later step is recorded first."""
    def edit(events):
        computes = _computes(events)
        a = next(e for e in computes if e["node"] == f"{first}{mb}.0")
        b = next(e for e in computes if e["node"] in {f"{k}{mb}.0" for k in then})
        a["node"], b["node"] = b["node"], a["node"]
    return edit


ORDERS = {("1f1b", "BW before F"): ("F", ("BW",)), ("zb-h1", "B before F"): ("F", ("B",)),
          ("zb-h1", "W before B"): ("B", ("W",))}


@pytest.mark.parametrize("algorithm, order", sorted(ORDERS))
@pytest.mark.parametrize("rank", range(PP))
@pytest.mark.parametrize("mb", [0, 7])
@pytest.mark.parametrize("command", ["calibrate", "vis"])
def test_steps_out_of_order(tmp_path, algorithm, order, rank, mb, command):
    dump = make_dump(tmp_path / "d", iterations=(0,), algorithm=algorithm)
    path = dump_path(dump, 0, rank)
    data = json.loads(path.read_text())
    _swap(*ORDERS[(algorithm, order)], mb)(data["ranks"][0]["events"])
    path.write_text(json.dumps(data))
    out = tmp_path / "cost.yaml"
    argv = ["calibrate", dump, "-o", out, "--warmup", "0"] if command == "calibrate" else \
        ["vis", dump, "--html", tmp_path / "o.html"]
    outcome = refused(run_cli(argv, watch=tmp_path), f"rank {rank}", f"{order.split()[0][0]}{mb}.0",
                      case=f"{command} {algorithm} {order} mb {mb} rank {rank}", before_work=True)
    assert "cannot complete" not in outcome.message, outcome.message
    not_valid_afterwards(out)


@pytest.mark.parametrize("rank", [0, PP - 1])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5, 0.99])
def test_truncated_rank_files(tmp_path, rank, fraction):
    only = make_dump(tmp_path / "only", iterations=(0,))
    several = make_dump(tmp_path / "several", iterations=(0, 1, 2))
    for dump, iteration in ((only, 0), (several, 1)):
        path = dump_path(dump, iteration, rank)
        path.write_bytes(path.read_bytes()[:int(path.stat().st_size * fraction)])
    refused(run_cli(["calibrate", only, "-o", tmp_path / "c.yaml", "--warmup", "0"]), f"rank_{rank}.json",
            case=f"calibrate rank {rank} truncated to {fraction:.0%}, the only iteration")
    outcome = run_cli(["calibrate", several, "-o", tmp_path / "c2.yaml", "--warmup", "0"])
    skipped = outcome.code == 0 and "skipped iteration 1" in outcome.err and f"rank_{rank}.json" in outcome.err
    record("sound" if skipped else outcome.kind, f"calibrate rank {rank} truncated to {fraction:.0%}, one of three")
    assert skipped, outcome.err


@pytest.mark.parametrize("iteration", [1, 2])
@pytest.mark.parametrize("t0", [0.0, 999.0])
def test_wall_clock_stamps_out_of_order(tmp_path, iteration, t0):
    """An iteration's ``meta.t0_unix`` (every rank's, the ranks' offsets kept) before the one before it ended: the
    step gap cannot be measured. It was left out of the cost file without a word (simulate then counted no gap); now
    a note says so."""
    dump = make_dump(tmp_path / "d", iterations=(0, 1, 2))
    paths = [dump_path(dump, iteration, rank) for rank in range(PP)]
    stamps = [json.loads(path.read_text())["meta"]["t0_unix"] for path in paths]
    for path, stamp in zip(paths, stamps):
        data = json.loads(path.read_text())
        data["meta"]["t0_unix"] = t0 + stamp - min(stamps)
        path.write_text(json.dumps(data))
    outcome = run_cli(["calibrate", dump, "-o", tmp_path / "c.yaml", "--warmup", "0"])
    said = outcome.code == 0 and "no host.step_gap" in outcome.out + outcome.err
    record("sound" if said else outcome.kind, f"calibrate iteration {iteration} t0_unix {t0}")
    assert said, outcome.out + outcome.err


@pytest.mark.parametrize("rank", [0, 1, PP - 1])
@pytest.mark.parametrize("skew", [-500.0, -5.0, 5.0, 86400.0])
@pytest.mark.parametrize("command", ["calibrate", "vis"])
def test_ranks_whose_clocks_disagree(tmp_path, rank, skew, command):
    """One rank's ``t0_unix`` off by more than a step (hosts whose clocks were never synchronised): a receive ends
    before its send began. ``vis`` drew a step of days, every rank 100 % idle, and calibrate's replay was 100 % off,
    without a word; now the only iteration is refused naming the ranks and the clocks, one of several skipped."""
    only = make_dump(tmp_path / "only", iterations=(0,))
    several = make_dump(tmp_path / "several", iterations=(0, 1, 2))
    for dump, iteration in ((only, 0), (several, 1)):
        path = dump_path(dump, iteration, rank)
        data = json.loads(path.read_text())
        data["meta"]["t0_unix"] += skew
        path.write_text(json.dumps(data))
    argv = {"calibrate": ["-o", tmp_path / "c.yaml", "--warmup", "0"], "vis": []}[command]
    case = f"{command} rank {rank}'s clock {skew:+g} s"
    refused(run_cli([command, only, *argv]), "clocks", f"rank {rank}", case=f"{case}, the only iteration",
            before_work=True)
    outcome = run_cli([command, several, *argv, *(["--iteration", 1] if command == "vis" else [])])
    if command == "vis":  # the iteration asked for: refused
        refused(outcome, "clocks", case=f"{case}, the iteration drawn", before_work=True)
        return
    skipped = outcome.code == 0 and "skipped iteration 1" in outcome.err and "clocks" in outcome.err
    record("sound" if skipped else outcome.kind, f"{case}, one of three")
    assert skipped, outcome.err
