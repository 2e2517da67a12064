"""Transport semantics as data: the deadlock replay under gloo, NCCL's per-pair and per-group streams,
batched groups and primuspipe's per-direction channels.

The figures the issue was filed with hold: today's tables are safe under gloo and primuspipe's
semantics and almost all of them hang under ``nccl-pair`` (the legacy fixture, exported before the
transport changed, is the worked example); the refusal names the streams, ranks and nodes of the
cycle. A per-direction stream adds no constraint over gloo's per-direction matching, so the two
verdicts agree on every table, including randomly reordered ones.
"""

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from primuspipe.errors import ConfigError, ValidationError
from primuspipe.io.formats import load_table
from primuspipe.passes.streams import SEMANTICS, replay
from primuspipe.passes.validation import validate
from posting_orders import BATCH_WAITS
from shipped_tables import shipped_tables
from simulator_support import text_table

LEGACY = Path(__file__).parents[1] / "fixtures" / "legacy_1f1b_pp2_m4.json"


def _shipped(pps=(2, 3, 4)):
    return shipped_tables([(pp, m) for pp in pps for m in (pp, 2 * pp + 1)], each_vpp=True)


def test_the_legacy_table_is_refused_under_nccl_pair_naming_the_cycle():
    table = load_table(LEGACY)
    validate(table, semantics="gloo")
    with pytest.raises(ValidationError) as err:
        validate(table, semantics="nccl-pair")
    text = str(err.value)
    assert err.value.rule == "deadlock" and "nccl-pair" in text
    assert "rank 0 node 2 (RECV_B0.0<1) needs its peer rank 1 node 4 (SEND_B0.0>0)" in text
    assert "queued on rank 1's pair stream 0<->1 behind rank 1 node 2 (RECV_F1.0<0)" in text
    assert "queued on rank 0's pair stream 0<->1 behind rank 0 node 2 (RECV_B0.0<1)" in text
    assert {(0, 2), (0, 4), (1, 2), (1, 4)} <= set(err.value.nodes)


def test_cli_validate_takes_the_semantics():
    script = shutil.which("primuspipe") or str(Path(sys.executable).parent / "primuspipe")

    def run(*args):
        return subprocess.run([script, "validate", str(LEGACY), *args], capture_output=True, text=True)
    refused, accepted = run("--semantics", "nccl-pair"), run("--semantics", "gloo")
    assert refused.returncode == 1 and "pair stream 0<->1" in refused.stdout
    assert accepted.returncode == 0 and "deadlock-free under the gloo transport semantics" in accepted.stdout
    bad = run("--semantics", "nccl")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_unknown_semantics_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown transport semantics 'rccl'"):
        validate(load_table(LEGACY), semantics="rccl")


def test_shipped_tables_are_safe_on_primuspipe_channels_and_mostly_hang_on_one_stream():
    tables = list(_shipped())
    refused = {name: sum(replay(t, name) is not None for t in tables) for name in SEMANTICS}
    assert refused["gloo"] == refused["primuspipe"] == 0
    assert refused["nccl-pair"] >= 0.9 * len(tables) and refused["nccl-group"] >= 0.9 * len(tables)


def _shuffled_comm(table, rng, moves: int):
    """The table with sends delayed and receives brought forward past a few compute nodes at random
    (each direction's order kept, so pairing holds): the table may then hang -- a delayed send -- or not."""
    rows = [list(row) for row in table.ranks]
    for _ in range(moves):
        row = rng.choice(rows)
        comms = [i for i, n in enumerate(row) if not n.kind.is_compute]
        if not comms:
            continue
        i = rng.choice(comms)
        step = 1 if row[i].kind.is_send else -1
        for _ in range(rng.randint(1, 6)):
            j = i + step
            if not 0 <= j < len(row) or not row[j].kind.is_compute:
                break
            row[i], row[j] = row[j], row[i]
            i = j
    return table.with_ranks(rows)


def test_per_direction_streams_add_no_constraint_over_gloo():
    rng = random.Random(5)
    agree = hangs = 0
    for table in _shipped(pps=(2, 3)):
        for _ in range(6):
            shuffled = _shuffled_comm(table, rng, moves=3 * table.pp)
            try:
                validate(shuffled, semantics="gloo")
                gloo_ok = True
            except ValidationError as exc:
                if exc.rule != "deadlock":
                    continue  # a receive moved after its consumer: not a transport question
                gloo_ok = False
            assert (replay(shuffled, "primuspipe") is None) == gloo_ok
            agree += 1
            hangs += not gloo_ok
    assert agree > 50 and hangs > 5, (agree, hangs)



def test_a_batched_receive_completes_for_its_rank_with_its_batch():
    """NCCL gives a batch (one group) one request: BW0.0 waits for the whole batch, not for the gradient
    of microbatch 0 alone, so rank 0 stops at BW0.0 -- where the NCCL emulator stops it
    (tests/runtime/test_nccl_differential.py) -- and the chain says why."""
    table = text_table(2, BATCH_WAITS, m=2)
    validate(table)  # primuspipe's per-direction streams run it
    hang = replay(table, "nccl-batched")
    assert hang.stopped == {0: 5, 1: 5} and hang.waits_on == {0: 3, 1: 4}
    assert any("rank 0 node 3 (RECV_B0.0<1) completes with its batch, which waits for rank 0 node 4 (RECV_B1.0<1)"
               in line for line in hang.chain), hang.chain
