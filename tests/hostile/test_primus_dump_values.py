"""Primus dump folders (``vis`` and ``calibrate`` read its runs' ``dump_pp_data``) whose JSON holds what Python's json
reads but no Primus run writes: an integer of more than 4,300 digits, nesting thousands deep, a key twice; times and
memory as integers too large for a float, a memory figure whose bytes overflow; iteration keys Primus never writes
(``"01"``, ``" 1"``, ``"+1"``, ``"1_0"``, ``"٣"``). Each is one line naming the file, before anything is drawn or
measured.

Defects this family found (round ten): the dump was read with Python's loose json, so the first two were a ValueError
and a RecursionError traceback and a key twice was read as its last value; ``math.isfinite`` of a 400-digit time and
``int()`` of 1e308 GiB in bytes were OverflowErrors; ``int()`` read each odd key as an iteration whose record was then
looked up under its canonical spelling, a KeyError."""

import json

import pytest

from hostile_support import make_primus_dump, refused, run_cli

RAW = {
    "config.json": {"integer of 5000 digits": '{"pp_size": ' + "9" * 5000 + ', "vp_size": 1, "num_mbs": 8}',
                    "nested 100000 deep": "[" * 100000 + "]" * 100000,
                    "pp_size twice": '{"pp_size": 4, "vp_size": 1, "num_mbs": 8, "pp_size": 2}'},
    "pp_rank_1.json": {"integer of 5000 digits": '{"1": {"total": ' + "9" * 5000 + "}}",
                       "nested 100000 deep": '{"1": ' + "[" * 100000 + "]" * 100000 + "}",
                       "iteration twice": '{"1": {}, "1": {}}'},
}
"""A whole file's text that Python's json reads (or chokes on) but no Primus run writes."""

RECORD = {"time of 400 digits": lambda r: r["fwd_start"].__setitem__(0, 10**400),
          "memory of 400 digits": lambda r: r.update(memory=10**400),
          "memory whose bytes overflow": lambda r: r.update(memory=1e308),
          "time as text": lambda r: r["fwd_end"].__setitem__(0, "2.0")}
"""Edits of rank 1's record: numbers JSON holds that no float (or no time) is."""

KEYS = ["01", " 1", "+1", "1_0", "٣", "1e0", "-1", "9" * 30]
"""Iteration keys Primus never writes (it writes ``str(iteration)``)."""

COMMANDS = ["vis", "calibrate"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("file, label", [(f, label) for f, texts in RAW.items() for label in texts])
def test_json_no_primus_run_writes(tmp_path, command, file, label):
    dump = make_primus_dump(tmp_path / "p")
    (dump / file).write_text(RAW[file][label])
    refused(run_cli([command, dump]), file, case=f"{command} primus dump {file}: {label}", before_work=True)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("label", sorted(RECORD))
def test_numbers_no_float_holds(tmp_path, command, label):
    dump = make_primus_dump(tmp_path / "p", RECORD[label])
    refused(run_cli([command, dump]), "pp_rank_1.json", case=f"{command} primus dump {label}", before_work=True)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("key", KEYS, ids=ascii)
def test_iteration_keys_primus_never_writes(tmp_path, command, key):
    dump = make_primus_dump(tmp_path / "p")
    for rank in range(4):
        path = dump / f"pp_rank_{rank}.json"
        records = json.loads(path.read_text())
        path.write_text(json.dumps({key: records["1"]}))
    refused(run_cli([command, dump]), "pp_rank_0.json", "iteration", case=f"{command} primus iteration key {key!r}",
            before_work=True)
