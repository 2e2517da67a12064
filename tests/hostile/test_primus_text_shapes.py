"""Primus's printed table form (``validate``, ``load_table``) whose shape is huge: each header number (``pp``,
``vpp``, ``microbatches``) and each node's microbatch and chunk -- the first and the last node of every rank, with
the header and without it (then vpp and the microbatch count are inferred from the nodes) -- at sizes past any
table, under both layouts; and header values that are not one item (``algorithm=zbvpp=2``, a value with a control or
format character). Each is one line naming the file, within a second.

Defects this family found: without a header, ``(F|0|99999999)`` made vpp 100,000,000 and the interleaved placement
was built stage by stage before the table's size was checked (a hang), as was a header's ``vpp=99999999`` with
``placement=interleaved``; ``# primuspipe: algorithm=zbvpp=2 vpp=2 ...`` (a blank lost) named the table ``zbvpp=2``
and its pp came from the rank lines; a header's ``algorithm=zb\\u202ev`` was printed back in ``validate``'s verdict;
a rank line's number of more than 4,300 digits was int()'s ValueError (round ten).
"""

import re

import pytest

from hostile_support import refused, run_cli
from primuspipe.algorithms.build import build_schedule
from primuspipe.io.formats import dump_table

HUGE = [10**6, 10**8, 10**9 - 1]
"""Past any table (a rank line's numbers have at most 9 digits; the header's are read as counts)."""
BASES = {"interleaved": ("interleaved-1f1b", 2), "v": ("zbv", None)}


def _text(layout: str) -> str:
    name, vpp = BASES[layout]
    return dump_table(build_schedule(name, 2, 4, vpp, communication=False), "primus")


def _header_cases():
    for layout in BASES:
        for key in ("pp", "vpp", "microbatches"):
            for value in HUGE:
                yield f"{layout} header {key}={value}", layout, lambda text, k=key, v=value: re.sub(
                    rf" {k}=\d+", f" {k}={v}", text, count=1)


def _node_cases():
    for layout in BASES:
        for field, where in (("microbatch", 2), ("chunk", 3)):
            for value in HUGE:
                for headed in (True, False):
                    yield (f"{layout} {'headed' if headed else 'bare'} {field}={value}", layout,
                           lambda text, w=where, v=value, h=headed: _nodes_set(text, w, v, h))


def _nodes_set(text: str, group: int, value: int, headed: bool) -> str:
    """The first and the last node of every rank line with the ``group``-th number (2: microbatch, 3: chunk)."""
    lines = text.splitlines()
    out = lines[:1] if headed else []
    for line in lines[1:]:
        nodes = list(re.finditer(r"\((\w+)\|(\d+)\|(\d+)\)", line))
        for m in (nodes[-1], nodes[0]):  # last first, so the first's offsets still hold
            parts = [m[1], m[2], m[3]]
            parts[group - 1] = str(value)
            line = line[:m.start()] + f"({'|'.join(parts)})" + line[m.end():]
        out.append(line)
    return "\n".join(out)


def _header_items():
    bad = {"a blank lost": lambda t: t.replace(" pp=", "pp=", 1),
           "a newline-free control character": lambda t: t.replace("algorithm=", "algorithm=x\x1b[2J", 1),
           "a right-to-left override": lambda t: t.replace("algorithm=", "algorithm=zb\u202e", 1),
           "a zero-width space": lambda t: t.replace("algorithm=", "algorithm=zb\u200b", 1),
           "a value with '='": lambda t: t.replace("placement=", "placement=v=", 1)}
    for layout in BASES:
        for label, edit in bad.items():
            yield f"{layout} header with {label}", layout, edit


def _rank_numbers():
    """The last rank line's number at sizes past any table, up to past int()'s 4,300 digits."""
    for layout in BASES:
        for digits in (10, 19, 5000):
            yield f"{layout} rank number of {digits} digits", layout, lambda t, d=digits: re.sub(
                r"^Rank 1:", f"Rank {'9' * d}:", t, count=1, flags=re.MULTILINE)


CASES = [*_header_cases(), *_node_cases(), *_header_items(), *_rank_numbers()]


@pytest.mark.parametrize("label, layout, edit", CASES, ids=[c[0] for c in CASES])
def test_primus_text_refused_naming_the_file(tmp_path, label, layout, edit):
    path = tmp_path / "table.txt"
    path.write_text(edit(_text(layout)))
    refused(run_cli(["validate", path]), str(path), case=f"validate primus text {label}")


@pytest.mark.parametrize("layout", sorted(BASES))
def test_the_texts_edited_are_valid(tmp_path, layout):
    """The edits above are the only fault: the texts they start from validate."""
    path = tmp_path / "table.txt"
    path.write_text(_text(layout))
    outcome = run_cli(["validate", path])
    assert outcome.code == 0, outcome.out
