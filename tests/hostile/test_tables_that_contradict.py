"""Tables that contradict themselves are refused, not read as something else: Primus's printed form
whose header disagrees with its rows, with stray or mistyped tokens, other digits, terminal escape
sequences; JSON whose placement name is not its stages. A message never echoes a control character."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import accepted, refused, run_cli
from primuspipe.algorithms.build import build_schedule
from primuspipe.io.formats import dump_table

TEXT = dump_table(build_schedule("zbv", pp=2, microbatches=4), "primus")
HEADER, *ROWS = TEXT.splitlines()


def _validate(tmp_path, text, name="t.txt"):
    path = tmp_path / name
    path.write_text(text)
    return run_cli(["validate", path])


def test_the_text_itself_is_valid(tmp_path):
    accepted(_validate(tmp_path, TEXT), case="primus text as exported")
    accepted(_validate(tmp_path, "\n".join(["INFO some log line", *ROWS, "trailing log"]) + "\n"),
             case="primus rows pasted from a log")


@pytest.mark.parametrize("header, names", [
    (HEADER.replace("pp=2", "pp=3"), ["pp=3", "2"]),
    (HEADER.replace("pp=2", "pp=1"), ["pp=1"]),
    (HEADER + " colour=red", ["colour=red"]),
    (HEADER + " stray", ["stray"]),
    (HEADER.replace("pp=2", "pp=２"), ["pp"]),
    (HEADER + " pp=2", ["twice"]),
    (HEADER.replace("microbatches=4", "microbatches=x"), ["microbatches"]),
    (HEADER.replace("placement=v", "placement=interleaved"), []),
])
def test_header_against_rows(tmp_path, header, names):
    refused(_validate(tmp_path, "\n".join([header, *ROWS]) + "\n"), *names, case=f"primus header {header[-20:]!r}")


TOKENS = ["(X|0|0)", "(F|a|0)", "(F|0)", "(F|0|0|0)", "F|0|0", "(F|-1|0)", "(F|０|0)", "(F|٣|0)", "junk", "(F|0|0)x",
          "((F|0|0))", "(F 0 0)", "\x1b[2J", "\x1b]0;title\x07", "(F|99999999999|0)", "(F|0|0);(B|0|0)"]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(TOKENS), st.integers(0, 1), st.integers(1, 30))
def test_a_bad_token_anywhere_is_named(tmp_path_factory, token, rank, where):
    """A token that is not a node, put anywhere after 'Rank r:' (text before it is a log line's prefix),
    is refused as itself, not as a missing node."""
    rows = list(ROWS)
    cells = rows[rank].split(",")
    where = min(where, len(cells))
    rows[rank] = ",".join([*cells[:where], token, *cells[where:]])
    outcome = refused(_validate(tmp_path_factory.mktemp("p"), "\n".join([HEADER, *rows]) + "\n"),
                      case=f"primus token {token!r}")
    assert "forwards" not in outcome.message and "\x1b" not in outcome.message + outcome.out + outcome.err
    assert "\x07" not in outcome.message + outcome.out + outcome.err


@pytest.mark.parametrize("line", ["Rank ١: (F|0|0)", "Rank ２: (F|0|0)", "Rank 1 (F|0|0)"])
def test_rank_numbers_in_other_digits_are_no_ranks(tmp_path, line):
    refused(_validate(tmp_path, "\n".join([HEADER, *ROWS, line]) + "\n"), case=f"primus rank line {line!r}")


def test_escape_sequences_are_not_echoed(tmp_path):
    text = "\n".join([HEADER, ROWS[0] + ",\x1b[31m\x1b]8;;http://x\x07(Q|0|0)\x1b[0m", ROWS[1]]) + "\n"
    outcome = refused(_validate(tmp_path, text), case="primus escape sequences")
    assert "\x1b" not in outcome.out + outcome.err and "\x07" not in outcome.out + outcome.err


@pytest.mark.parametrize("placement", [
    {"name": "v", "stages": [[0, 2], [1, 3]]},
    {"name": "interleaved", "stages": [[0, 3], [1, 2]]},
    {"name": "v", "stages": [[0], [1]]},
])
def test_placement_name_against_stages(tmp_path, placement):
    table = json.loads(build_schedule("interleaved-1f1b", pp=2, microbatches=4, vpp=2).to_json())
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**table, "placement": placement}))
    refused(run_cli(["validate", path]), "placement", case=f"table placement {placement}")
