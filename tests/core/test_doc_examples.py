"""Every example README.md and docs/*.md show runs as written on this checkout, and prints what they show.

The marker convention is :mod:`doc_examples`' (tests/support/doc_examples.py): fenced blocks tagged ``python``,
``bash`` or ``console`` are run, a ``<!-- not run: REASON -->`` line before a fence exempts its block (with the
reason), and a ``<!-- file: NAME -->`` line before a file-contents block (``yaml``, ...) writes it as NAME for the
page's later blocks. Each page runs in a fresh folder of its own, where ``examples`` and ``bench`` are the
repository's (so paths run as shown, and nothing is written into the checkout), block after block in page order
as a reader pastes them: ``python`` blocks share one namespace (a block of ``>>>`` lines is a doctest, its shown
results compared), ``bash`` and ``console`` lines run ``primuspipe`` in process and must exit 0, or 1 where
their comment says ``exit 1`` (a ``torchrun`` line is checked, not launched, and its dump stood in for, see
``doc_examples._torchrun``), and a ``console`` block's shown output must be
the command's output, line for line and figures included: when a change moves the figures, rewrite them with
``PYTHONPATH=.:tests/support python tests/support/doc_examples.py --write`` and read the diff.

Before, three tests covered three blocks (README's "Using it" without its dump, README's projection titles and
headers without figures, docs/authoring.md); a reader pasting docs/pp_vis.md used a cost file its section had not made
yet."""

import argparse
import re

import pytest

from primuspipe.cli import build_parser
from doc_examples import PAGES, RUN, blocks, mismatches, run_page


def test_every_page_has_a_block():
    assert len(PAGES) > 10 and sum(1 for p in PAGES for b in blocks(p) if b.lang in RUN and not b.not_run) >= 25


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_markers_say_why(page):
    """A marker names its reason and stands before a block it applies to: a not-run marker before a runnable
    block, a file marker before a file's contents."""
    text = page.read_text()
    assert "<!-- not run -->" not in text and "<!-- not run: -->" not in text
    for block in blocks(page):
        assert not block.not_run or block.lang in RUN, f"{block.where}: a not-run marker on a {block.lang!r} block"
        assert not block.file or block.lang not in RUN, f"{block.where}: a file marker on a {block.lang} block"
    marked = text.count("<!-- not run: ") + text.count("<!-- file: ")
    assert marked == sum(1 for b in blocks(page) if b.not_run or b.file), f"{page.name}: a marker before no fence"


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang in RUN and not b.not_run for b in blocks(p))],
                         ids=lambda p: p.name)
def test_page_examples_run_and_print_what_they_show(page, tmp_path, clean_registry):
    drift = mismatches(run_page(page, tmp_path))
    assert not drift, "the docs show other output than the commands print (rewrite: see this module's docstring):\n" + \
        "\n".join(drift)


def _options() -> dict[str, set[str]]:
    """Each subcommand's option strings, the top level's (-q, -v) included."""
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    top = {s for a in parser._actions for s in a.option_strings}
    return {name: top | {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_flags_the_docs_name_exist(page):
    """Wherever a page names ``primuspipe COMMAND --flag`` -- inline, in a synopsis, in a block not run -- the
    command has that flag: a renamed option cannot leave a doc behind."""
    options, unknown = _options(), []
    text = page.read_text().replace("\\\n", " ")
    for call in re.finditer(r"primuspipe(?:\s+-[qv])*\s+(\w+)\b([^`\n#]*)", text):
        if call.group(1) in options:
            flags = re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", call.group(2))
            unknown += [f"line {text[:call.start()].count(chr(10)) + 1}: {call.group(1)} {f}"
                        for f in flags if f not in options[call.group(1)]]
    assert not unknown, f"{page.name}: {unknown}"
