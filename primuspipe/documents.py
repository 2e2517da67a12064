"""The envelope every primuspipe JSON document carries (a ``format`` name and a ``version``), and how
documents are written (atomically).

Schedules and timelines are exchanged as files between machines and versions of primuspipe; a reader
refuses a document that is not of its format or version before reading any field, so a wrong file is
one clear error rather than a confusing one later.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any

from primuspipe import strict
from primuspipe.errors import OutputFileError, TableFormatError


def envelope(fmt: str, version: int) -> dict[str, Any]:
    """The first two fields of a document of ``fmt``."""
    return {"format": fmt, "version": version}


def check_envelope(data: Any, fmt: str, version: int, what: str, source: str | None = None) -> None:
    """Refuse ``data`` unless it is a mapping with ``format == fmt`` and ``version == version`` (an
    integer: ``true`` equals 1 in Python but is no version). ``source`` names the file in messages."""
    where = f"{source}: " if source else ""
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise TableFormatError(f"{where}not a primuspipe {what}: the JSON lacks format='{fmt}'")
    got = data.get("version")
    if type(got) is not int or got != version:
        raise TableFormatError(f"{where}{what} JSON version {got!r} is not supported (want the integer {version})")


SUFFIX_KINDS = {".json": "JSON", ".csv": "CSV", ".yaml": "YAML", ".yml": "YAML", ".png": "PNG", ".html": "HTML",
                ".htm": "HTML", ".svg": "SVG", ".pdf": "PDF", ".jpg": "JPEG", ".jpeg": "JPEG", ".dot": "Graphviz DOT",
                ".gv": "Graphviz DOT"}
"""File name endings that say what a file holds (the table reader takes a ``.csv`` as torch's CSV, a browser a
``.html`` as a page): an output whose name says one kind and gets another is refused (:func:`output_file`)."""
KIND_SUFFIX = {"JSON": ".json", "CSV": ".csv", "YAML": ".yaml", "PNG": ".png", "HTML": ".html",
               "Graphviz DOT": ".dot", "text": ".txt"}
"""The name ending :func:`output_file`'s refusal proposes for each kind a writer writes."""
NAMED_ONLY = frozenset({"CSV"})
"""Kinds a reader knows only by their name: ``load_table`` reads a table as torch's CSV only from a ``.csv`` file
(any other is JSON or Primus's text), so a CSV is written under no other name."""


def output_file(path: Any, what: str, *, create_folder: bool = True, writes: str | None = None) -> Path:
    """``path`` checked as a file a writer (the API's and every command's) may write, before it draws or
    serialises anything: a path (not ``123``), not a directory, nothing but a regular file where it exists
    (writers rename a finished file over the path: over a device node such as ``/dev/null``, a pipe or a
    socket that would replace it), a name the system can take, its folder created (``create_folder``) and
    writable, and -- where the writer says which kind of file it ``writes`` -- named as that kind
    (:func:`named_as`). Each failure is one :class:`OutputFileError` line naming ``what`` and the path."""
    path = strict.file_path(path, what, error=OutputFileError)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as exc:  # a name too long, a loop of links
        raise OutputFileError(f"cannot write {what} {path}: {exc.strerror or exc}; give a writable file path") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputFileError(f"cannot write {what} {path}: it is a directory; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        raise OutputFileError(f"cannot write {what} {path}: it exists and is not a regular file (a device, pipe or "
                              "socket, which writing would replace); give a file name")
    if writes is not None:
        named_as(path, what, writes)
    if create_folder:
        strict.writable_folder(path.parent, f"the folder of {what} {path}", error=OutputFileError)
    return path


def named_as(path: Path, what: str, writes: str) -> None:
    """Refuse ``path`` for a file of the kind a writer ``writes`` (a key of :data:`KIND_SUFFIX`) where its name says
    another kind (:data:`SUFFIX_KINDS`: a CSV table written to ``t.json`` is a file ``validate`` reads as JSON and
    refuses; a PNG written to ``x.svg`` is no SVG). A name ending in none of them is the user's choice, but for a
    kind known only by its name (:data:`NAMED_ONLY`)."""
    named = SUFFIX_KINDS.get(path.suffix.lower())
    if named == writes or named is None and writes not in NAMED_ONLY:
        return
    why = (f"its name ends in {path.suffix}, which says {named}, but it would hold {writes}" if named else
           f"a {writes} file is read as one only under a {KIND_SUFFIX[writes]} name")
    raise OutputFileError(f"cannot write {what} {strict.shown_path(path)}: {why}; name it "
                          f"{strict.shown_path(path.with_suffix(KIND_SUFFIX[writes]))}")


def write_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so that no reader ever sees part of it: into a hidden temporary file
    beside it, then renamed over it (a process killed mid-write leaves the old file or none). A path that
    cannot be written (a directory, a missing or read-only folder, a full disk) is an
    :class:`OutputFileError` naming it -- the API's callers get the project's error, not an OSError."""
    path = output_file(path, "output file", create_folder=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:  # named as the file the caller asked for: the temporary one is ours
        _remove(tmp)
        raise OutputFileError(f"cannot write {path}: {exc.strerror or exc}; give a writable file path") from None
    except BaseException:
        _remove(tmp)
        raise
    return path


def _remove(tmp: Path) -> None:
    """Delete a temporary file if it is there; a folder that never was (``a_file/x.json``) has nothing to delete."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
