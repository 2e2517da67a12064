"""A command's output files: every path checked before any work, all written or none.

The policy every command that writes follows:

* before any work, each output path is checked on its own (not a directory, its folder can be created
  and written) and against the rest: an output may not be one of the command's inputs -- the same
  file by ``os.path.samefile`` or by resolved path, or a file inside an input directory (a dump) --
  nor another output of the same command (``--png x --html x``);
* ``-`` is standard output wherever a single file is written (``export -o -``, ``calibrate -o -``), and
  at most one output may go there;
* at the end every output is first written to a hidden temporary file beside its destination and only
  when all of them are written are they renamed into place: a failed write (a full disk, a folder made
  unwritable meanwhile) leaves no output behind, and the error names the user's path, never the
  temporary one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from primuspipe.documents import named_as, output_file
from primuspipe.errors import ConfigError

STDOUT = "-"

Writer = Callable[[Path], object]
"""Writes one output to the path it is given (the temporary file)."""


class Outputs:
    """The files one command writes, registered (and checked) up front, written by :meth:`commit`."""

    def __init__(self, inputs: Iterable[Path | str | None] = ()):
        self.inputs = [Path(p) for p in inputs if p is not None and str(p) != STDOUT]
        self._claimed: list[tuple[str, Path]] = []
        self._writers: list[tuple[str, Path, Writer]] = []
        self._stdout: str | None = None

    def claim(self, path: Path | str | None, flag: str, *, stdout: bool = True,
              writes: str | None = None) -> Path | None:
        """Check ``path`` as the output of ``flag`` (None: not asked for; ``-``: standard output, where
        ``stdout`` allows it; ``writes``: the kind of file it gets, not to be named as another,
        :func:`~primuspipe.documents.named_as`, checked last: a collision says more) and reserve it; returns it (None
        for standard output or nothing)."""
        if path is None:
            return None
        if str(path) == STDOUT:
            if not stdout:
                raise ConfigError(f"{flag} - means standard output, which {flag} cannot write to; give a file name")
            if self._stdout is not None:
                raise ConfigError(f"{flag} - and {self._stdout} - both write to standard output; give one of them a file")
            self._stdout = flag
            return None
        path = Path(path)
        output_file(path, flag)
        for source in self.inputs:
            if same_file(path, source) or source.is_dir() and _inside(path, source):
                where = "is" if same_file(path, source) else "lies inside"
                raise ConfigError(f"{flag} {path} {where} the input {source}; writing it would destroy what the "
                                  "command reads; write the output elsewhere")
        for other_flag, other in self._claimed:
            if same_file(path, other):
                raise ConfigError(f"{flag} {path} and {other_flag} {other} are the same file; give each output its "
                                  "own path")
        if writes is not None:
            named_as(path, flag, writes)
        self._claimed.append((flag, path))
        return path

    def write(self, path: Path, flag: str, writer: Writer) -> None:
        """Queue ``writer`` to produce ``path`` (claimed before) at :meth:`commit`."""
        self._writers.append((flag, path, writer))

    def write_text(self, path: Path, flag: str, text: str) -> None:
        self.write(path, flag, lambda tmp: tmp.write_text(text))

    def commit(self) -> list[Path]:
        """Write every queued output to a temporary file beside it, then rename them all into place."""
        done: list[tuple[Path, Path]] = []
        try:
            for flag, path, writer in self._writers:
                tmp = path.with_name(f".{path.name}.{os.getpid()}.part{path.suffix}")
                done.append((tmp, path))
                try:
                    writer(tmp)
                except OSError as exc:
                    raise ConfigError(f"cannot write {flag} {path}: {exc.strerror or exc}; nothing was written") from None
            for tmp, path in done:
                try:
                    os.replace(tmp, path)
                except OSError as exc:
                    raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
        except BaseException:
            for tmp, _ in done:
                tmp.unlink(missing_ok=True)
            raise
        return [path for _, path in done]


def same_file(a: Path, b: Path) -> bool:
    """The same file: equal once resolved (links, ``..``), or by inode where both exist (hard links). A name
    holding a NUL names no file (the input's reader refuses it; comparing it was a ValueError)."""
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _inside(path: Path, folder: Path) -> bool:
    try:
        real, top = os.path.realpath(path), os.path.realpath(folder)
    except ValueError:  # a NUL in the name, as in same_file
        return False
    return os.path.commonpath([real, top]) == top
