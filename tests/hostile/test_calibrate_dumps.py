"""``primuspipe calibrate`` over damaged timeline dumps, the input issue 27's loop calibrates from: every timed
field of an event (``start``, ``end``, ``cpu``, ``bytes``, ``layers``, ``ends``) and of a rank (``peak_memory_bytes``)
at NaN, infinity, negative, 1e300-and-beyond, text, null or missing, on the first, a middle and the last event of
the first and the last rank; ranks missing, a node duplicated, nodes outside the table, a rank with no events, an
empty iteration folder. One iteration only (``--warmup 0``), so nothing can be skipped: each must be refused in
one line naming the field or the rank, and leave no cost file behind."""

import json

import pytest

from hostile_support import PP, make_dump, not_valid_afterwards, refused, run_cli
from primuspipe.io.timeline import dump_path

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "negative": -1.0, "1e309": "1e309",
          "text": "x", "null": None, "list": [1], "true": True}
EVENT_FIELDS = ["start", "end", "cpu", "bytes", "layers", "ends"]


def _edit(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))  # NaN and Infinity as JSON's literals, which the reader refuses


def _calibrate(dump, out):
    return run_cli(["calibrate", dump, "-o", out, "--warmup", "0"])


def _set(event, field, value):
    if value == "missing":
        event.pop(field, None)
    elif field == "cpu":
        event["cpu"] = [0.0, value]
    elif field in ("layers", "ends"):
        event[field] = [value]
    else:
        event[field] = value


@pytest.mark.parametrize("field", EVENT_FIELDS)
@pytest.mark.parametrize("value", [*VALUES, "missing"])
@pytest.mark.parametrize("rank, which", [(0, 0), (PP - 1, "middle"), (PP - 1, -1)])
def test_event_fields(tmp_path, field, value, rank, which):
    if value == "missing" and field not in ("start", "end"):
        return  # the optional fields may be left out
    if value == "null" and field in ("bytes",):
        return  # null is "not measured"
    dump = make_dump(tmp_path / "d", iterations=(0,))

    def edit(data):
        events = data["ranks"][0]["events"]
        _set(events[len(events) // 2 if which == "middle" else which], field, VALUES.get(value, value))

    _edit(dump_path(dump, 0, rank), edit)
    out = tmp_path / "cost.yaml"
    # NaN and infinity are JSON's non-standard literals, refused by the parser, which names the file, not the key
    names = [f"rank_{rank}.json"] if value in ("nan", "inf", "-inf") else [field]
    refused(_calibrate(dump, out), *names, case=f"calibrate {field}={value} rank {rank}")
    not_valid_afterwards(out)


@pytest.mark.parametrize("value", ["nan", "inf", "negative", "1e309", "text", "list", "true"])
def test_peak_memory(tmp_path, value):
    dump = make_dump(tmp_path / "d", iterations=(0,))
    _edit(dump_path(dump, 0, 1), lambda d: d["ranks"][0].update(peak_memory_bytes=VALUES[value]))
    names = ["rank_1.json"] if value in ("nan", "inf") else ["peak_memory_bytes"]  # JSON's literals: the parser's
    refused(_calibrate(dump, tmp_path / "cost.yaml"), *names, case=f"calibrate peak_memory_bytes={value}")


def _duplicate(d):
    events = d["ranks"][0]["events"]
    events.append({**events[-1], "start": events[-1]["end"], "end": events[-1]["end"] + 0.01})


@pytest.mark.parametrize("name, edit, names", [
    ("a node twice", _duplicate, []),
    ("a forward past the microbatches", lambda d: d["ranks"][0]["events"][0].update(node="F8.0"), ["F8.0"]),
    ("a chunk past vpp", lambda d: d["ranks"][0]["events"][0].update(node="F0.1"), ["F0.1"]),
    ("a send past the ranks", lambda d: d["ranks"][0]["events"][1].update(node=f"SEND_F0.0>{PP}"), ["outside"]),
    ("not a node", lambda d: d["ranks"][0]["events"][0].update(node="X0.0"), ["X0.0"]),
    ("no events", lambda d: d["ranks"][0].update(events=[]), []),
    ("events not a list", lambda d: d["ranks"][0].update(events={}), ["events"]),
    ("no ranks", lambda d: d.update(ranks=[]), []),
])
@pytest.mark.parametrize("rank", [0, PP - 1])
def test_iterations_that_are_not_the_table(tmp_path, name, edit, names, rank):
    dump = make_dump(tmp_path / "d", iterations=(0,))
    _edit(dump_path(dump, 0, rank), edit)
    refused(_calibrate(dump, tmp_path / "cost.yaml"), *names, case=f"calibrate {name} rank {rank}")


@pytest.mark.parametrize("missing", [{0}, {PP - 1}, {1, 2}, set(range(PP))])
def test_ranks_missing(tmp_path, missing):
    dump = make_dump(tmp_path / "d", iterations=(0,))
    for rank in missing:
        dump_path(dump, 0, rank).unlink()
    refused(_calibrate(dump, tmp_path / "cost.yaml"), case=f"calibrate ranks {sorted(missing)} missing")
