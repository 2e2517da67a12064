"""Round thirteen: outputs named as another kind of file than the one written, through every writer of the command
line (found from the parser) and of the API, at every name ending that says a kind (``documents.SUFFIX_KINDS``).
Each mismatch is one line naming the flag or writer, the path and the name to give, before any work; a name of the
writer's own kind, or of none, is written -- and a table is read back by ``validate`` as what was written.

Defects this family found: ``export --format csv -o t.json`` (and ``save_table(t, "t.json", "csv")``) wrote a CSV
that ``validate t.json`` then refused as bad JSON; ``export -o t.csv`` wrote JSON that it refused as a CSV action
``'{'``; ``--format primus -o t.csv`` likewise. ``show --graph g.svg`` wrote Graphviz text into an SVG name (the help
says ``dot -Tsvg FILE`` draws it), ``vis --png x.svg`` a PNG, ``--trace x.html`` JSON, ``calibrate -o c.json`` YAML
with comments: files whose names deny what they hold. And an input path holding a NUL beside an output was a
ValueError traceback in the check that an output is no input (``os.path.realpath``); it is now the input reader's
refusal (tests/hostile/test_input_file_kinds.py)."""

from __future__ import annotations

import pytest

from hostile_support import accepted, refused, run_api, run_cli, subcommands
from primuspipe.algorithms.build import build_schedule
from primuspipe.documents import KIND_SUFFIX, NAMED_ONLY, SUFFIX_KINDS
from primuspipe.io.formats import load_table, save_table
from primuspipe.io.timeline import Timeline
from primuspipe.ir.cost_model import CostModel
from primuspipe.simulator import simulate
from primuspipe.simulator.trace import write_chrome_trace
from primuspipe.tools.pp_vis import write_trace
from primuspipe.tools.pp_vis.html import write_html
from primuspipe.tools.pp_vis.png import draw_png

TABLE = build_schedule("1f1b", 2, 4)
TIMELINE = simulate(TABLE, CostModel.per_stage(2, 1.0, 1.0, 1.0)).timeline()
API_WRITERS = {
    "save_table json": ("JSON", lambda path: save_table(TABLE, path, "json")),
    "save_table csv": ("CSV", lambda path: save_table(TABLE, path, "csv")),
    "save_table primus": ("text", lambda path: save_table(TABLE, path, "primus")),
    "Timeline.save": ("JSON", TIMELINE.save),
    "write_chrome_trace": ("JSON", lambda path: write_chrome_trace(path, TIMELINE, TABLE.placement)),
    "write_trace": ("JSON", lambda path: write_trace(TIMELINE, path)),
    "draw_png": ("PNG", lambda path: draw_png(TIMELINE, path)),
    "write_html": ("HTML", lambda path: write_html(TIMELINE, path)),
}
"""Each API writer and the kind of file it writes."""

CLI_WRITERS = {
    ("show", "graph"): ("Graphviz DOT", ["show", "1f1b", "--pp", "2", "-m", "4", "--graph", "OUT"]),
    ("export", "output"): ("JSON", ["export", "1f1b", "--pp", "2", "-m", "4", "--format", "json", "-o", "OUT"]),
    ("export", "output csv"): ("CSV", ["export", "1f1b", "--pp", "2", "-m", "4", "--format", "csv", "-o", "OUT"]),
    ("export", "output primus"): ("text", ["export", "1f1b", "--pp", "2", "-m", "4", "--format", "primus", "-o",
                                           "OUT"]),
    ("vis", "png"): ("PNG", ["vis", "TIMELINE", "--png", "OUT"]),
    ("vis", "html"): ("HTML", ["vis", "TIMELINE", "--html", "OUT"]),
    ("vis", "trace"): ("JSON", ["vis", "TIMELINE", "--trace", "OUT"]),
    ("calibrate", "output"): ("YAML", ["calibrate", "TIMELINE", "-o", "OUT"]),
}
"""Each output option of the command line (export's once per format) and the kind of file it writes; simulate's -o
names a folder, whose files it names itself."""


def _suffixes(kind: str) -> list[tuple[str, bool]]:
    """``(name ending, written)`` for a writer of ``kind``: every ending of another kind (refused), its own ending and
    none at all (written; a CSV table refused: ``load_table`` reads a CSV only under a ``.csv`` name)."""
    return [(suffix, False) for suffix, named in sorted(SUFFIX_KINDS.items()) if named != kind] + \
        [(KIND_SUFFIX[kind], True), ("", kind not in NAMED_ONLY)]


def test_every_output_option_is_swept():
    options = {(name, action.dest) for name, parser in subcommands().items() for action in parser._actions
               if action.dest in {"output", "output_dir", "png", "html", "trace", "graph"}}
    assert options - {("simulate", "output_dir")} == {(c, o.split()[0]) for c, o in CLI_WRITERS}


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    path = tmp_path_factory.mktemp("names") / "run.timeline.json"
    TIMELINE.save(path)
    return path


API_CASES = [(writer, suffix, written) for writer, (kind, _) in sorted(API_WRITERS.items())
             for suffix, written in _suffixes(kind)]


@pytest.mark.parametrize("writer, suffix, written", API_CASES, ids=[f"{w}{s or ' bare'}" for w, s, _ in API_CASES])
def test_api_writer(tmp_path, writer, suffix, written):
    kind, write = API_WRITERS[writer]
    path = tmp_path / f"out{suffix}"
    case = f"API {writer} to a {suffix or 'bare'} name"
    if not written:
        refused(run_api(write, path), str(path), suffix, case=case)
        assert list(tmp_path.iterdir()) == [], f"{case}: written"
        return
    accepted(run_api(write, path), case=case)
    if writer.startswith("save_table"):  # read back as the table written
        assert load_table(path).ranks == TABLE.ranks


CLI_CASES = [(option, argv, suffix, written) for option, (kind, argv) in sorted(CLI_WRITERS.items())
             for suffix, written in _suffixes(kind)]


@pytest.mark.parametrize("option, argv, suffix, written", CLI_CASES,
                         ids=[f"{' '.join(o)}{s or ' bare'}" for o, _, s, _ in CLI_CASES])
def test_command_output(tmp_path, timeline, option, argv, suffix, written):
    out = tmp_path / f"out{suffix}"
    flag = argv[argv.index("OUT") - 1]
    argv = [{"OUT": out, "TIMELINE": timeline}.get(a, a) for a in argv]
    case = f"{' '.join(option)} to a {suffix or 'bare'} name"
    if not written:
        refused(run_cli(argv, watch=tmp_path), flag, str(out), case=case, before_work=True)
        assert not out.exists()
        return
    accepted(run_cli(argv), case=case)
    if option[0] == "export":  # what export wrote, validate reads back as that table
        accepted(run_cli(["validate", out]), case=f"validate what {case} wrote")


@pytest.mark.parametrize("suffix", [".json", ".csv", ".CSV", ".txt", "", ".yaml"])
def test_export_format_by_name(tmp_path, suffix):
    """Without --format the -o name decides, as save_table's default does (a CSV for .csv, else JSON), and what
    is written validates: -o t.csv wrote JSON that validate read as a CSV action '{'."""
    out = tmp_path / f"t{suffix}"
    outcome = run_cli(["export", "zb-h1", "--pp", "2", "-m", "4", "-o", out])
    if suffix == ".yaml":
        refused(outcome, "-o", ".yaml", case="export -o t.yaml (no --format)")
        return
    accepted(outcome, case=f"export -o t{suffix} (no --format)")
    accepted(run_cli(["validate", out]), case=f"validate export -o t{suffix}")
    assert load_table(out).ranks == build_schedule("zb-h1", 2, 4).ranks
