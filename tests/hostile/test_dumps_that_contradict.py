"""Dumps that contradict themselves -- a dropped event, a duplicated microbatch, a header microbatch count
that is not the events', negative times, an algorithm changing within one run, CPU stamps in reverse --
are refused naming the rank and the node, before anything is drawn or measured; never as "run validate"
or as a cost-model field ("host.cores must be > 0") the user never wrote."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import PP, make_dump, make_primus_dump, refused, run_cli
from primuspipe.io.timeline import dump_path

MISLEADING = ("validate", "host.cores", "cannot complete")


def _edit(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _computes(data):
    return [e for e in data["ranks"][0]["events"] if "_" not in e["node"]]


def _drop(i):
    def edit(data):
        data["ranks"][0]["events"].remove(_computes(data)[i % len(_computes(data))])
    return edit


def _duplicate(i):
    """One compute node renamed to its neighbour of the same kind: that microbatch runs twice, one never."""
    def edit(data):
        computes = _computes(data)
        a = computes[i % len(computes)]
        b = next(e for e in computes if e is not a and e["node"][0] == a["node"][0] and e["node"] != a["node"])
        a["node"] = b["node"]
    return edit


def _reverse_cpu(data):
    for e in _computes(data):
        e["cpu"] = [1.0, 0.5]


EDITS = {
    "drop": _drop,
    "duplicate": _duplicate,
    "header m larger": lambda i: lambda d: d.update(microbatches=d["microbatches"] + 1 + i % 3),
    "cpu reversed": lambda i: _reverse_cpu,
}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(EDITS)), st.integers(0, 40), st.integers(0, PP - 1),
       st.sampled_from(["vis", "calibrate", "vis --iteration 0"]))
def test_one_rank_file_contradicts_itself(tmp_path_factory, what, i, rank, command):
    dump = make_dump(tmp_path_factory.mktemp("dump"), iterations=(0,))
    _edit(dump_path(dump, 0, rank), EDITS[what](i))
    if what == "header m larger":  # every rank's header: the events hold fewer microbatches than it says
        for r in range(PP):
            _edit(dump_path(dump, 0, r), EDITS[what](i))
    argv = [*command.split(), dump]
    outcome = refused(run_cli(argv), case=f"{command} dump {what}", before_work=True)
    assert not any(word in outcome.message for word in MISLEADING), outcome.message


def test_algorithm_changes_within_one_run(tmp_path):
    dump = make_dump(tmp_path / "d", iterations=(0, 1, 2))
    for rank in range(PP):
        _edit(dump_path(dump, 1, rank), lambda d: d.update(algorithm="gpipe"))
    for command in ("vis", "calibrate"):
        refused(run_cli([command, dump]), "run-a", case=f"{command} dump algorithm changes within a run")


def _shift(record):
    record["fwd_start"] = [s - 100 for s in record["fwd_start"]]
    record["fwd_end"] = [s - 100 for s in record["fwd_end"]]


PRIMUS_EDITS = {
    "negative times": _shift,
    "dropped forward": lambda r: [r[k].pop() for k in ("fwd_start", "fwd_end", "fwd_minibatch", "fwd_chunk")],
    "duplicate microbatch": lambda r: r["fwd_minibatch"].__setitem__(1, r["fwd_minibatch"][0]),
}


@pytest.mark.parametrize("what", sorted(PRIMUS_EDITS))
@pytest.mark.parametrize("command", ["vis", "calibrate"])
def test_primus_dumps_that_contradict(tmp_path, what, command):
    dump = make_primus_dump(tmp_path / "p", PRIMUS_EDITS[what])
    outcome = refused(run_cli([command, dump]), case=f"{command} primus dump {what}", before_work=True)
    assert not any(word in outcome.message for word in MISLEADING), outcome.message


def test_primus_config_microbatches_differ_from_events(tmp_path):
    dump = make_primus_dump(tmp_path / "p")
    (dump / "config.json").write_text(json.dumps({"pp_size": PP, "vp_size": 1, "num_mbs": 12}))
    refused(run_cli(["vis", dump]), case="vis primus config m differs from the events")


def test_the_untouched_dumps_still_read(tmp_path):
    for argv in (["vis", make_dump(tmp_path / "d")], ["calibrate", tmp_path / "d"],
                 ["vis", make_primus_dump(tmp_path / "p")], ["calibrate", tmp_path / "p"]):
        outcome = run_cli(argv)
        assert outcome.code == 0, outcome.err
