"""Run dumps and saved timelines whose ``meta`` facts -- every fact a reader uses, listed from the reader itself
(``timeline._FACTS``: the run id, host, CPU times, core counts, wall-clock stamps, the simulator's step figures) --
hold a value of another type: a list, a mapping, a boolean, a number for a name, a name for a number, NaN text, a
negative time, a zero core count, a control character. Set in one rank file of a run dump (``vis``, ``calibrate``),
in a saved timeline's per-rank ``meta.ranks`` and as its ``meta.placement``. Each is one line naming the fact.

Defects this family found: a ``run_id`` that was a list or a mapping was a TypeError traceback in ``vis`` and
``calibrate`` (runs are told apart by it, and a list cannot be a key); a ``host`` that was a list was one in
``calibrate`` (ranks on one host are counted by it); the other facts were taken as given -- text CPU seconds, a
run id of ``true`` or with a newline -- and ``meta.ranks`` was never checked at all.
"""

import json
import shutil

import pytest

from hostile_support import accepted, make_dump, refused, run_cli
from primuspipe.io import timeline

NUMBER_FACTS = [k for k, reader in timeline._FACTS.items() if reader in (timeline._seconds, timeline._share)]
COUNT_FACTS = [k for k, reader in timeline._FACTS.items() if reader is timeline._cores]
TEXT_FACTS = [k for k, reader in timeline._FACTS.items() if reader is timeline._text_or_null]
ANY_WRONG = [[1], {"a": 1}, True]
WRONG = {**{k: ANY_WRONG + ["NaN", "x", -1.0, "1e999"] for k in NUMBER_FACTS},
         **{k: ANY_WRONG + [0, 1.5, "2", -3] for k in COUNT_FACTS},
         **{k: ANY_WRONG + [5, 1.5, "", "a\nb", "x\x1b[31m"] for k in TEXT_FACTS}}
CASES = [(k, v) for k, values in WRONG.items() for v in values]


def test_every_fact_is_swept():
    """A fact added to the reader joins the sweep (or fails here, if of a new kind)."""
    assert set(NUMBER_FACTS) | set(COUNT_FACTS) | set(TEXT_FACTS) == set(timeline._FACTS)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    return make_dump(tmp_path_factory.mktemp("meta") / "dump", iterations=(0,))


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v!r}" for k, v in CASES])
def test_rank_file_meta(tmp_path, dump, key, value):
    root = tmp_path / "dump"
    shutil.copytree(dump, root)
    rank_file = next(root.rglob("rank_1.json"))
    data = json.loads(rank_file.read_text())
    data["meta"][key] = value
    rank_file.write_text(json.dumps(data))
    refused(run_cli(["vis", root, "--json"]), f"meta.{key}", case=f"vis dump meta.{key}={value!r}")
    refused(run_cli(["calibrate", root, "--warmup", "0", "-o", tmp_path / "c.yaml"]), f"meta.{key}",
            case=f"calibrate dump meta.{key}={value!r}")


@pytest.mark.parametrize("key", NUMBER_FACTS)
def test_rank_file_meta_number_text_is_read_as_the_number(tmp_path, dump, key):
    """A number fact written as text (``"t0_unix": "1000.0"``) reads as that number, as the field readers read
    number text everywhere: the run is drawn and calibrated as with the number (a text ``t0_unix`` was a TypeError
    traceback where the ranks' clocks are merged)."""
    root = tmp_path / "dump"
    shutil.copytree(dump, root)
    rank_file = next(root.rglob("rank_1.json"))
    data = json.loads(rank_file.read_text())
    data["meta"][key] = repr(float(data["meta"].get(key, 0.5)))
    rank_file.write_text(json.dumps(data))
    accepted(run_cli(["vis", root, "--json"]), case=f"vis dump meta.{key}={data['meta'][key]!r}")
    accepted(run_cli(["calibrate", root, "--warmup", "0", "-o", tmp_path / "c.yaml"]),
             case=f"calibrate dump meta.{key}={data['meta'][key]!r}")


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("simulated")
    assert run_cli(["simulate", "-a", "1f1b", "--pp", "2", "-m", "4", "-o", folder]).code == 0
    return json.loads(next(folder.glob("*.timeline.json")).read_text())


def _vis_refuses_meta(tmp_path, simulated, key, value, named):
    """A saved timeline whose ``meta[key]`` is ``value``: ``vis`` refuses it in one line naming ``named``."""
    data = json.loads(json.dumps(simulated))
    data["meta"][key] = value
    path = tmp_path / "t.timeline.json"
    path.write_text(json.dumps(data))
    refused(run_cli(["vis", path, "--json"]), named, case=f"vis timeline meta.{key}={value!r}")


@pytest.mark.parametrize("key, value", CASES[::3], ids=[f"{k}={v!r}" for k, v in CASES[::3]])
def test_saved_timeline_rank_facts(tmp_path, simulated, key, value):
    _vis_refuses_meta(tmp_path, simulated, "ranks", [{"rank": 0, key: value}], f"meta.ranks[0].{key}")


@pytest.mark.parametrize("ranks", [5, "x", [5], [{"host": "a"}], [{"rank": -1}], [{"rank": True}]])
def test_saved_timeline_rank_list(tmp_path, simulated, ranks):
    _vis_refuses_meta(tmp_path, simulated, "ranks", ranks, "meta.ranks")


@pytest.mark.parametrize("placement", [[1], {"name": "interleaved"}, {"name": "v", "stages": [[0], [1]]},
                                       {"name": "custom", "stages": [[0, 0], [1, 1]]}])
def test_saved_timeline_placement(tmp_path, simulated, placement):
    _vis_refuses_meta(tmp_path, simulated, "placement", placement, "meta.placement")
