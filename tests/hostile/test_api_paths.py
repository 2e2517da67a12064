"""The Python API's file readers and writers given a path that is not one (``123``, ``None``, bytes, a list,
blank text, text holding a NUL) and, for writers, a path that cannot be written: a directory, a folder that is a
file (``a_file/x.json``), an existing directory for a CSV (and its sidecar), a pipe, a socket or a link to a pipe
(stand-ins for device nodes: the test makes them, so code without the check replaces nothing that matters), a loop
of links, a name or a path longer than the system takes. Each is one PrimusPipeError line naming the path or the
argument, raised before anything is drawn or written, and a stand-in is still what it was; a missing folder is
created (sound).

Defects this family found: ``load_table(123)``, ``Timeline.load(None)``, ``load_timeline(1)`` and
``save_table(t, 123)`` raised ``Path``'s TypeError; ``save_table``/``Timeline.save``/``write_trace`` to a directory
raised IsADirectoryError, and under a file NotADirectoryError (``write_atomically`` re-raised OSError, and its
clean-up of the temporary file raised again); ``draw_png`` and ``write_html`` drew the whole figure before
failing on the path with matplotlib's or plotly's OSError. Round eight: every API writer renamed its file over a
pipe, a socket or a device node (``save_table(t, "/dev/zero")`` replaced the device with a JSON file: the command
line refused such outputs, the API's own check did not -- two checks of one concept, now one); a path holding a NUL
was ``os.stat``'s ValueError in every reader and writer, a name too long an OSError traceback in every writer."""

import os
import socket
import stat

import pytest

from hostile_support import accepted, Outcome, refused, run_api
from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.megatron.config import load_config
from primuspipe.io.formats import load_table, save_table
from primuspipe.io.timeline import Timeline
from primuspipe.ir.cost_model import CostModel
from primuspipe.ir.cost_file import read_cost_file
from primuspipe.projection.hardware_spec import load_hardware
from primuspipe.projection.megatron_args import read_megatron_config
from primuspipe.projection.model_spec import load_model
from primuspipe.projection.training_spec import load_training
from primuspipe.simulator import simulate
from primuspipe.simulator.trace import write_chrome_trace
from primuspipe.tools.pp_vis import load_iterations, load_timeline, write_trace
from primuspipe.tools.pp_vis.html import write_html
from primuspipe.tools.pp_vis.png import draw_png

TABLE = build_schedule("1f1b", 2, 4)
TIMELINE = simulate(TABLE, CostModel.per_stage(2, 1.0, 1.0, 1.0)).timeline()

NOT_PATHS = [123, 2.5, None, True, b"/tmp/x.json", [], ["x.json"], {}, "   ", object(), "/tmp/a\x00b.json"]
"""Values of a path argument that are no path (``load_config``'s ``None`` is "no file" and ``""`` too)."""

READERS = {
    "load_table": load_table, "read_cost_file": read_cost_file, "Timeline.load": Timeline.load,
    "load_timeline": load_timeline, "load_iterations": load_iterations, "load_model": load_model,
    "load_hardware": load_hardware, "load_training": load_training, "read_megatron_config": read_megatron_config,
    "load_config": lambda path: load_config(path, env={}),
}
WRITERS = {
    "save_table json": lambda path: save_table(TABLE, path),
    "save_table csv": lambda path: save_table(TABLE, path, "csv"),
    "Timeline.save": TIMELINE.save,
    "write_chrome_trace": lambda path: write_chrome_trace(path, TIMELINE, TABLE.placement),
    "write_trace": lambda path: write_trace(TIMELINE, path),
    "draw_png": lambda path: draw_png(TIMELINE, path),
    "write_html": lambda path: write_html(TIMELINE, path),
}
UNWRITABLE = {"a directory": "{d}", "under a file": "{d}/a_file/out.x", "a directory, trailing slash": "{d}/sub/",
              "a directory named like a file": "{d}/dir.json", "a pipe": "{d}/fifo.json", "a socket": "{d}/sock",
              "a link to a pipe": "{d}/to_fifo.json", "a loop of links": "{d}/loop.json",
              "a name too long": "{d}/" + "x" * 300 + ".json", "a path too long": "{d}/" + "d/" * 2100 + "t.json"}
"""Output paths no file can be written at (``{d}`` is the case's folder; ``sub`` and ``dir.json`` are folders,
``fifo.json`` a pipe, ``sock`` a socket, ``to_fifo.json`` a link to the pipe, ``loop.json`` a link to itself)."""
STAND_INS = {"fifo.json": stat.S_ISFIFO, "sock": stat.S_ISSOCK, "to_fifo.json": stat.S_ISLNK, "loop.json": stat.S_ISLNK}


def _readers():
    for name, fn in READERS.items():
        for value in NOT_PATHS:
            if name in ("load_training", "load_config") and value is None:
                continue  # None: the default training settings; no config file
            yield f"{name}({str(value)[:10]!r})", fn, value


def _writers():
    for name, fn in WRITERS.items():
        for value in NOT_PATHS:
            yield f"{name}({str(value)[:10]!r})", fn, value
        for how, path in UNWRITABLE.items():
            yield f"{name} to {how}", fn, path


READ_CASES, WRITE_CASES = list(_readers()), list(_writers())


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "a_file").write_text("a file in the way")
    (tmp_path / "sub").mkdir()
    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "to_fifo.json").symlink_to(tmp_path / "fifo.json")
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    yield tmp_path
    server.close()


@pytest.mark.parametrize("case, fn, value", READ_CASES, ids=[c[0] for c in READ_CASES])
def test_reader_given_no_path(case, fn, value):
    refused(run_api(fn, value), case=f"API {case}")


@pytest.mark.parametrize("case, fn, value", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
def test_writer_given_a_bad_path(case, fn, value, folder):
    before = sorted(p.name for p in folder.rglob("*"))
    path = value.format(d=folder) if isinstance(value, str) and "{d}" in value else value
    outcome = refused(run_api(fn, path), *([str(path).rstrip("/")] if isinstance(value, str) and "{d}" in value
                                           else []), case=f"API {case}")
    assert sorted(p.name for p in folder.rglob("*")) == before, f"{case}: files left behind"
    assert all(kind(os.lstat(folder / name).st_mode) for name, kind in STAND_INS.items()), f"{case}: a stand-in replaced"
    assert outcome.message


@pytest.mark.parametrize("name", list(WRITERS))
def test_writer_creates_a_missing_folder(name, tmp_path):
    """The edge beside the refusals: a folder that does not exist yet is made, the file written."""
    path = tmp_path / "new" / "deeper" / ("out.csv" if name == "save_table csv" else "out.x")  # a CSV only as .csv
    outcome = run_api(WRITERS[name], path)
    accepted(Outcome("silent" if outcome.kind == "silent" else outcome.kind, 0 if outcome.kind == "silent" else 1,
                     outcome.message), case=f"API {name} to a missing folder")
    assert path.is_file()
