"""Running the examples that help texts and docs show, as a reader would paste them.

The convention for README.md and docs/*.md (tests/core/test_doc_examples.py runs it): a fenced block tagged
``python``, ``bash`` or ``console`` is an example a reader runs, and the test runs it; untagged fences
(diagrams, output excerpts, usage synopses, placeholders such as ``<your flags>``) and file contents
(``yaml``, ``json``, ``toml``) are not run. A tagged block that cannot run on a CPU-only checkout in a test
(it needs a GPU, the reader's own model or file, minutes) carries ``<!-- not run: REASON -->`` on the line
before its fence, REASON saying why and, where one exists, which test covers it instead. A file's contents the
examples after it read (a ``yaml`` cost model) carry ``<!-- file: NAME -->``: the test writes the block as NAME.

``console`` blocks show ``$ COMMAND`` lines, each followed by what the command prints (standard output): the
test compares every line, figures included. After a change that moves them, rewrite them with
``PYTHONPATH=.:tests/support python tests/support/doc_examples.py --write`` and read the diff.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib.util
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hostile_support import Outcome, make_dump, run_cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("python", "bash", "console")
NOT_RUN = re.compile(r"<!-- not run: (.*?) -->")
FILE = re.compile(r"<!-- file: (\S+) -->")
SHARED = ("examples", "bench")
"""Repository folders a page's folder links to, so the paths the docs show resolve."""
CONSOLE_COLUMNS = "200"
"""The terminal width the console blocks' tables were printed at."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """The line of the opening fence (1-based)."""
    lang: str
    text: str
    not_run: str | None
    """The reason of a ``<!-- not run: REASON -->`` marker on the line before the fence."""
    file: str | None
    """The NAME of a ``<!-- file: NAME -->`` marker on the line before the fence."""

    @property
    def where(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``: a fence opens with a backtick run and an optional tag, closes with a bare
    backtick run."""
    found, lines = [], page.read_text().splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        if start is None and (opening := re.match(r"```(\S*)\s*$", line)):
            start, lang = number, opening.group(1)
        elif start is not None and line.rstrip() == "```":
            before = next((lines[i] for i in range(start - 2, -1, -1) if lines[i].strip()), "")
            marker, file = NOT_RUN.fullmatch(before.strip()), FILE.fullmatch(before.strip())
            found.append(Block(page, start, lang, "\n".join(lines[start:number - 1]) + "\n",
                               marker.group(1) if marker else None, file.group(1) if file else None))
            start = None
    assert start is None, f"{page.name}:{start}: a fence that never closes"
    return found


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command line, the lines shown as its output) of a ``bash`` or ``console`` block: continuation lines joined;
    in ``bash`` every non-comment line is a command and nothing is shown, in ``console`` a command starts with
    ``$ `` and the lines up to the next one are its output."""
    text = block.text.replace("\\\n", " ")
    if block.lang == "bash":
        return [(line.strip(), []) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    found = []
    for part in re.split(r"^\$ ", text, flags=re.M)[1:]:
        command, *shown = part.rstrip("\n").split("\n")
        found.append((command.strip(), [line.rstrip() for line in shown]))
    return found


def _example_parser(script: Path):
    spec = importlib.util.spec_from_file_location(f"doc_example_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def _torchrun(argv: list[str]) -> None:
    """A ``torchrun`` line is not launched here (several ranks, tens of seconds: tests/megatron and
    tests/backends_torch run the examples): its script must exist and take its arguments, and a ``--dump-dir``
    gets the dump such a run writes (a simulated step of its algorithm and shape, iterations 0 and 1), so the
    lines after it read a dump as they would after the run."""
    if "-m" in argv:
        module = argv[argv.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        return
    [script] = [a for a in argv if a.endswith(".py")]
    try:
        args = _example_parser(Path(script))(argv[argv.index(script) + 1:])
    except SystemExit as refused:  # argparse, its message on stderr
        raise AssertionError(f"{script} refuses the arguments shown (exit {refused.code}): see stderr") from None
    if getattr(args, "dump_dir", None):
        make_dump(Path(args.dump_dir), pp=args.pp, algorithm=args.pp_algorithm or "1f1b",
                  microbatches=args.microbatches)


@contextlib.contextmanager
def _environment(assignments: dict[str, str]):
    saved = {k: os.environ.get(k) for k in assignments}
    os.environ.update(assignments)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_line(example: str) -> list[Outcome]:
    """Run one shown line in the current folder: ``VAR=value`` assignments first set the environment; ``primuspipe
    ...`` runs in process and must end with status 0, or 1 where the line's comment says 'exit 1'; steps joined by
    ``&&`` run in turn; ``torchrun ...`` as :func:`_torchrun`; ``source ...`` (a shell's) is skipped. The
    outcomes of the ``primuspipe`` steps, in order."""
    expected = 1 if "exit 1" in example else 0
    outcomes = []
    for step in " ".join(shlex.split(example, comments=True)).split(" && "):
        argv = shlex.split(step)
        assignments = {}
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
            key, _, value = argv.pop(0).partition("=")
            assignments[key] = value
        with _environment(assignments):
            if argv[0] == "primuspipe":
                outcome = run_cli(argv[1:])
                assert outcome.code == expected, f"{example}: exit {outcome.code}\n{outcome.err}{outcome.out[-2000:]}"
                outcomes.append(outcome)
            elif argv[0] == "torchrun":
                _torchrun(argv[1:])
            else:
                assert argv[0] == "source", f"{example}: the doc test runs primuspipe, torchrun and source lines only"
    return outcomes


def run_example(example: str) -> None:
    """Run one shown ``primuspipe`` line (help texts' examples) as :func:`run_line`."""
    assert shlex.split(example, comments=True)[0] == "primuspipe", example
    run_line(example)


@dataclass
class Shown:
    """A ``console`` command, the output its page shows and what it printed."""
    block: Block
    command: str
    shown: list[str]
    printed: list[str] = field(default_factory=list)


def _python(block: Block, namespace: dict) -> None:
    """Run a python block in ``namespace``: as a doctest when it shows ``>>>`` lines, else as a script."""
    if block.text.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(block.text, namespace, block.where, str(block.page), block.line)
        report = []
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=report.append, clear_globs=False)
        assert not runner.failures, "the doctest fails\n" + "".join(report)
    else:
        exec(compile("\n" * block.line + block.text, str(block.page), "exec"), namespace)


def run_page(page: Path, folder: Path) -> list[Shown]:
    """Run ``page``'s examples in ``folder`` (see the module docstring); the console commands with what they
    printed."""
    for name in SHARED:
        (folder / name).symlink_to(ROOT / name)
    namespace: dict = {"__name__": "__doc_example__"}
    shown = []
    with contextlib.chdir(folder), _environment({"COLUMNS": CONSOLE_COLUMNS}):
        for block in blocks(page):
            if block.file:
                (folder / block.file).write_text(block.text)
            if block.lang not in RUN or block.not_run:
                continue
            try:
                if block.lang == "python":
                    _python(block, namespace)
                    continue
                for command, lines in commands(block):
                    outcomes = run_line(command)
                    if block.lang == "console":
                        printed = [line.rstrip() for line in outcomes[-1].out.splitlines()]
                        shown.append(Shown(block, command, lines, printed))
            except Exception as error:
                raise AssertionError(f"{block.where}: {error}") from error
    return shown


def _trimmed(lines: list[str]) -> list[str]:
    while lines and not lines[-1]:
        lines = lines[:-1]
    return lines


def mismatches(shown: list[Shown]) -> list[str]:
    """One line per console command whose shown output is not what it printed: the first line that differs."""
    found = []
    for s in shown:
        want, got = _trimmed(s.shown), _trimmed(s.printed)
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            found.append(f"{s.block.where}: $ {s.command[:80]}\n  line {at + 1} shown:   "
                         f"{want[at] if at < len(want) else '(nothing)'}\n  line {at + 1} printed: "
                         f"{got[at] if at < len(got) else '(nothing)'}")
    return found


def write(page: Path) -> bool:
    """Rewrite ``page``'s console blocks with what their commands print now; whether anything changed."""
    with tempfile.TemporaryDirectory() as folder:
        shown = run_page(page, Path(folder))
    text = original = page.read_text()
    lines = text.split("\n")
    for block in sorted({s.block for s in shown}, key=lambda b: -b.line):
        parts = []
        for s in (s for s in shown if s.block == block):
            command_lines = next(p for p in re.split(r"^\$ ", block.text, flags=re.M)[1:]
                                 if p.replace("\\\n", " ").split("\n")[0].strip() == s.command)
            head = command_lines.split("\n")
            kept = ["$ " + head[0]]
            while kept[-1].endswith("\\"):
                kept.append(head[len(kept)])
            parts.append("\n".join(kept + _trimmed(s.printed)))
        end = block.line + len(block.text.rstrip("\n").split("\n"))
        lines[block.line:end] = "\n\n".join(parts).split("\n")
    text = "\n".join(lines)
    if text != original:
        page.write_text(text)
    return text != original


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=.:tests/support python tests/support/doc_examples.py --write")
    for page in PAGES:
        if any(b.lang == "console" and not b.not_run for b in blocks(page)) and write(page):
            print(f"rewrote {page.relative_to(ROOT)}")
