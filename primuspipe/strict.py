"""The strict input layer: every file, number, count and key that comes from outside passes through here.

One small set of parsers serves every format (table JSON and CSV, cost YAML, the Megatron config YAML
and its environment variables, run dumps, command-line numbers), so they refuse the same things the
same way, each with one line that names the file, the field and what to write instead:

* numbers are finite: NaN and infinity are refused, and so are booleans (``true`` is not ``1``);
* counts are integers: ``2.5``, ``2.0``, ``true`` and non-ASCII digits (``２``, which Python's ``int``
  would read) are refused; text is read as a count only where the input is text (CLI, environment);
* mappings have known keys only; an unknown one is named with the closest known key;
* documents are bounded: a file of at most :data:`MAX_DOCUMENT_BYTES`, UTF-8, nested at most
  :data:`MAX_DEPTH` deep; JSON without ``NaN``/``Infinity`` and duplicate keys; YAML without aliases
  (so an alias bomb cannot expand), duplicate keys, and YAML 1.1's octal ``010`` and base-60 ``1:30`` (8 and 90
  to PyYAML, 10 and text to a YAML 1.2 reader); a value its tag cannot build (``!!int x``) is a YAML error.

Each parser takes the :class:`~primuspipe.errors.PrimusPipeError` subclass its format raises
(``TableFormatError`` for schedules and timelines, ``ConfigError`` for costs and settings).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import math
import numbers
import os
import re
import stat
import types
import typing
import collections.abc
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from primuspipe.errors import ConfigError, PrimusPipeError

MAX_DOCUMENT_BYTES = 128 * 2**20
"""Largest file read as a table, timeline, cost model or config (a table of the largest buildable shape,
:data:`~primuspipe.ir.table.MAX_NODES` nodes, is about 60 MiB of JSON)."""
MAX_DEPTH = 32
"""Deepest nesting of lists and mappings in a document (the formats need 4)."""

_COUNT_TEXT = re.compile(r"[+-]?[0-9]{1,18}", re.ASCII)
NUMBER_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
"""A number written out in ASCII (``float()`` would also take full-width digits, ``1_0`` and ``nan``)."""

Error = type[PrimusPipeError]


# -- values -------------------------------------------------------------------------------------------
def number(value: Any, name: str, *, error: Error = ConfigError, minimum: float | None = None,
           maximum: float | None = None, above: float | None = None) -> float:
    """``value`` as a finite float; ASCII number text (``"1e9"``, which YAML leaves a string) is read too.

    ``minimum``/``maximum`` bound it inclusively, ``above`` exclusively.

    >>> number("1e-3", "p2p_time")
    0.001
    >>> number(float("nan"), "compute.f")
    Traceback (most recent call last):
    ...
    primuspipe.errors.ConfigError: compute.f must be a finite number, got nan (NaN and infinity are not allowed)
    """
    if _is_bool(value) or not isinstance(value, (numbers.Real, str)):
        raise error(f"{name} must be a number, got {show(value)}")
    if isinstance(value, str) and not NUMBER_TEXT.fullmatch(value.strip()):
        raise error(f"{name} must be a number (finite, in ASCII digits, e.g. 1.5 or 2e-3), got {value!r}")
    try:
        x = float(value)
    except (OverflowError, ValueError):
        x = math.inf
    if not math.isfinite(x):
        raise error(f"{name} must be a finite number, got {show(value)} (NaN and infinity are not allowed)")
    if minimum is not None and x < minimum:
        raise error(f"{name} must be >= {minimum:g}, got {show(value)}")
    if above is not None and x <= above:
        raise error(f"{name} must be > {above:g}, got {show(value)}")
    if maximum is not None and x > maximum:
        raise error(f"{name} must be <= {maximum:g}, got {show(value)}")
    return x


def count(value: Any, name: str, *, error: Error = ConfigError, minimum: int = 0, maximum: int | None = None,
          text: bool = False) -> int:
    """``value`` as an integer; ``text=True`` (command lines, environment variables) also reads ASCII
    digit strings. Booleans, floats (``2.0`` too) and other digits (``２``) are refused.

    >>> count(4, "microbatches", minimum=1)
    4
    >>> count(2.5, "microbatches")
    Traceback (most recent call last):
    ...
    primuspipe.errors.ConfigError: microbatches must be an integer, got 2.5
    """
    if isinstance(value, str) and text:
        if not _COUNT_TEXT.fullmatch(value.strip()):
            digits = value.strip().lstrip("+-")
            why = "of at most 18 digits" if digits.isascii() and digits.isdigit() else "written with ASCII digits"
            raise error(f"{name} must be an integer {why}, got {show(value)}")
        value = int(value)
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise error(f"{name} must be an integer, got {show(value)}")
    value = int(value)  # numpy's integers are sizes too
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum:,}, got {value:,}")
    return value


def _is_bool(value: Any) -> bool:
    """Python's and numpy's booleans (``numpy.bool_`` is no ``bool`` subclass): never a number or a count."""
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool") and hasattr(value, "dtype")


def text(value: Any, name: str, *, error: Error = ConfigError, choices: Collection[str] | None = None) -> str:
    """A non-empty string of printable characters (one of ``choices`` when given): a name read from a file is
    printed back (``validate``'s verdict, ``show``'s title, a report row), where a newline split the line and an
    escape sequence drove the terminal."""
    if not isinstance(value, str) or not value.strip():
        raise error(f"{name} must be a non-empty string, got {show(value)}")
    if not value.isprintable():
        raise error(f"{name} must be printable text on one line (no control or format characters), got {show(value)}")
    if choices is not None and value not in choices:
        raise error(f"{name} must be one of {', '.join(sorted(choices))}, got {value!r}{did_you_mean(value, choices)}")
    return value


def flag(value: Any, name: str, *, error: Error = ConfigError) -> bool:
    """A boolean; text (environment) may say 1/0, true/false, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off", ""):
            return False
    raise error(f"{name}: {show(value)} is not a boolean; write true/false, 1/0, yes/no or on/off")


def keys(data: Any, name: str, allowed: Collection[str], required: Collection[str] = (), *,
         error: Error = ConfigError) -> dict[str, Any]:
    """``data`` as a dict with only ``allowed`` keys and all ``required`` ones (``None`` is empty)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise error(f"{name} must be a mapping of {', '.join(sorted(allowed))}, got {show(data)}")
    if unknown := [key for key in data if key not in allowed]:
        raise error(f"{name} has unknown key(s) {sorted(map(str, unknown))}{did_you_mean(unknown[0], allowed)}; "
                    f"allowed: {', '.join(sorted(allowed))}")
    if missing := sorted(set(required) - set(data)):
        raise error(f"{name} lacks {missing}")
    return dict(data)


def closest(word: str, known: Collection[str], cutoff: float = 0.6) -> str | None:
    """The known word ``word`` most likely misspells, if any is that close (``cutoff``: difflib's ratio)."""
    found = difflib.get_close_matches(str(word), list(known), n=1, cutoff=cutoff)
    return found[0] if found else None


def did_you_mean(word: Any, known: Collection[str]) -> str:
    """`` (did you mean 'x'?)`` when ``word`` is close to a known word, else empty."""
    near = closest(str(word), known)
    return f" (did you mean {near!r}?)" if near else ""


def scalar(value: str, name: str, *, error: Error = ConfigError) -> Any:
    """A command-line value (``-O KEY=VALUE``): an integer, a finite number, ``true``/``false``,
    ``none``/``null``, else the text itself; ``nan`` and ``inf`` are refused.

    >>> [scalar(v, "option") for v in ("4", "1e-3", "true", "none", "abc")]
    [4, 0.001, True, None, 'abc']
    """
    word = value.strip()
    if _COUNT_TEXT.fullmatch(word):
        return int(word)
    if NUMBER_TEXT.fullmatch(word) or word.lower().lstrip("+-") in ("nan", "inf", "infinity"):
        return number(word, name, error=error)
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    if word.lower() in ("none", "null"):
        return None
    return value


def instance(value: Any, kind: type, name: str, *, error: Error = ConfigError) -> Any:
    """``value`` when it is a ``kind``: an API entry point's argument of another type is one line naming the
    argument, not an AttributeError inside (or, for ``validate(None)``, a pass)."""
    if not isinstance(value, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise error(f"{name} must be {article} {kind.__name__}, got {'None' if value is None else type(value).__name__}")
    return value


def of_type(value: Any, annotation: Any, name: str, *, error: Error = ConfigError) -> Any:
    """``value`` checked against a parameter annotation of ``int``, ``float``, ``bool``, ``str`` and
    ``None`` (or their union, e.g. ``int | None``); an int is a valid float. Other annotations pass."""
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    simple = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "none"}
    if not all(t in simple for t in allowed):
        return value
    if value is None and type(None) in allowed:
        return value
    if isinstance(value, bool):
        if bool in allowed:
            return value
    elif isinstance(value, int) and (int in allowed or float in allowed):
        return value
    elif isinstance(value, float) and float in allowed:
        return number(value, name, error=error)
    elif isinstance(value, str) and str in allowed:
        return value
    raise error(f"{name} must be {' or '.join(simple[t] for t in allowed)}, got {show(value)}")


class _Mismatch(Exception):
    pass


def fields(obj: Any, *, error: Error = ConfigError) -> None:
    """Each field of the dataclass value ``obj`` checked against its annotation (numbers, integers, text, flags,
    None, classes, tuples of them and unions of these): a value built in code with a field of another type is one
    line naming the class and the field -- ``Link("1")`` was a TypeError in its own range check, ``CostModel(compute,
    p2p=1.0)`` an AttributeError in the first pass that read it, ``KindSpec(..., category="compute")`` a kind that
    silently ran as a receive. A list where a tuple belongs is kept as a tuple (the values are frozen and hashed).
    Annotations of other forms pass; the class's own ``__post_init__`` checks ranges after this."""
    for name, hint in _field_hints(type(obj)):
        value = getattr(obj, name)
        try:
            conformed = _conform(value, hint)
        except _Mismatch:
            raise error(f"{type(obj).__name__}.{name} must be {_describe(hint)}, got {show(value)}") from None
        if conformed is not value:
            object.__setattr__(obj, name, conformed)


@functools.cache
def _field_hints(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


_CONTAINERS = (collections.abc.Sequence, collections.abc.Collection, collections.abc.Iterable)


def _conform(value: Any, hint: Any) -> Any:
    """``value`` if it is of ``hint`` (a list of a tuple's items as a tuple), else :class:`_Mismatch`."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        for arg in args:
            try:
                return _conform(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin in _CONTAINERS:  # Sequence[Timeline], Collection[...]: checked item by item, not copied
        if not isinstance(value, origin) or isinstance(value, (str, bytes)):
            raise _Mismatch
        if origin is collections.abc.Iterable or not args:  # an iterator is not consumed here
            return value
        item = args[0]
        if isinstance(item, type) and not getattr(item, "_is_protocol", False) and item not in (int, float):
            if not all(isinstance(v, item) for v in value):  # a table's rows of nodes: one C-speed pass
                raise _Mismatch
        elif any(_conform(v, item) is not v for v in value):
            raise _Mismatch
        return value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise _Mismatch
        if len(args) == 2 and args[1] is Ellipsis:
            items = tuple(_conform(v, args[0]) for v in value)
        elif len(args) == len(value):
            items = tuple(_conform(v, a) for v, a in zip(value, args))
        else:
            raise _Mismatch
        return value if type(value) is tuple and all(a is b for a, b in zip(items, value)) else items
    if hint is float or hint is int:
        kind = numbers.Real if hint is float else numbers.Integral
        if isinstance(value, kind) and not _is_bool(value):
            return value
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return value
        raise _Mismatch
    if getattr(hint, "_is_protocol", False):  # a Protocol (a binder): what it must do is the function's to check
        return value
    if isinstance(origin, type) and not isinstance(value, origin):  # Mapping[str, Any] and other generics: the kind
        raise _Mismatch
    if isinstance(hint, type) and not isinstance(value, hint):
        raise _Mismatch
    return value


def arguments(error: Error = ConfigError) -> Callable[[Callable], Callable]:
    """Decorator of a documented API function: each argument checked against its parameter's annotation as
    :func:`fields` checks a dataclass's fields (a list where a tuple belongs passed on as a tuple), and a call the
    signature cannot bind (an argument missing, one unknown) -- one line naming the function and the parameter,
    where ``draw_png(None, ...)`` or ``validate(table, retained="x")`` was a TypeError deep inside or silently kept.
    Value ranges stay the function's to check."""
    def wrap(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise error(f"{fn.__name__}(): {exc}") from None
            hints = _parameter_hints(fn)
            for name, value in bound.arguments.items():
                if (hint := hints.get(name)) is None:
                    continue
                try:
                    bound.arguments[name] = _conform(value, hint)
                except _Mismatch:
                    raise error(f"{fn.__name__}'s {name} must be {_describe(hint)}, got {show(value)}") from None
            return fn(*bound.args, **bound.kwargs)

        return checked

    return wrap


@functools.cache
def _parameter_hints(fn: Callable) -> dict[str, Any]:
    """The annotations of ``fn``'s named parameters (not ``*args``/``**kwargs``), resolved once; one that names what
    its module imports only for type checkers is left to the function."""
    hints = {}
    for name, p in inspect.signature(fn).parameters.items():
        if p.annotation is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            try:
                hints[name] = eval(p.annotation, inspect.unwrap(fn).__globals__) if isinstance(p.annotation, str) \
                    else p.annotation
            except NameError:
                pass
    return hints


def _describe(hint: Any) -> str:
    """What a value of ``hint`` is, for :func:`fields`' message."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType or origin is typing.Union:
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        return f"a tuple of {_items(hint)}"
    if origin in _CONTAINERS:
        return f"a list of {_items(tuple[args[0], ...])}" if args else "a list"
    simple = {float: "a number", int: "an integer", bool: "true or false", str: "a string", type(None): "None"}
    if hint in simple:
        return simple[hint]
    name = getattr(typing.get_origin(hint) or hint, "__name__", str(hint))
    return f"{'an' if name[0] in 'AEIOU' else 'a'} {name}"


def _items(hint: Any) -> str:
    """What a tuple of ``hint`` holds: ``numbers`` (``tuple[float, ...]``), ``2 items (a string, a number)``."""
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if typing.get_origin(item) is tuple:
            return f"tuples of {_items(item)}"
        plural = {float: "numbers", int: "integers", bool: "flags", str: "strings"}
        return plural.get(item, f"{getattr(item, '__name__', 'item')}s")
    return f"{len(args)} items ({', '.join(_describe(a) for a in args)})"


def printable(text: str) -> str:
    """``text`` with every control or other unprintable character escaped (``\\x1b``), so a message that
    quotes a file's or the user's text never drives the terminal it is printed on."""
    return "".join(ch if ch.isprintable() or ch == "\n" else ascii(ch)[1:-1] for ch in text)


def one_line(text: str) -> str:
    """``text`` with every control or unprintable character escaped, a newline and a tab included
    (:func:`printable` keeps a message's own line breaks): for text the user typed, printed inside a line."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def shown_path(path: str | os.PathLike) -> str:
    """``path`` as a message prints it (:func:`one_line`): a file name may hold a newline or an escape
    sequence, and a message that names a file must stay one line and never drive the terminal."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
    return one_line(text if isinstance(text, str) else os.fsdecode(text))


def paths_shown(text: str, paths: Iterable[str | os.PathLike]) -> str:
    """``text`` with each of ``paths`` (what the user typed: a command's arguments) that holds a character
    :func:`shown_path` escapes printed as that function prints it -- every message repeating a typed file
    name, wherever it was raised, then stays one line."""
    typed = {os.fspath(p) for p in paths if isinstance(p, (str, os.PathLike))}
    for path in sorted((p for p in typed if isinstance(p, str) and one_line(p) != p), key=len, reverse=True):
        text = text.replace(path, one_line(path))
    return text


def show(value: Any) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def file_path(value: Any, what: str, *, error: Error = ConfigError) -> Path:
    """``value`` as a file system path: a non-empty string or ``os.PathLike``; anything else (``123``,
    ``None``, bytes) is one line naming ``what``, not ``Path``'s TypeError; nor is one holding a NUL, which no
    file system takes (``os.stat``'s ValueError)."""
    spelt = str(os.fspath(value)) if isinstance(value, (str, os.PathLike)) else ""
    if not spelt.strip() or "\x00" in spelt:
        raise error(f"{what} must be a path (a non-empty string or os.PathLike), got {show(value)}")
    return Path(value)


def writable_folder(path: str | Path, name: str, *, error: Error = ConfigError) -> Path:
    """``path`` as a folder files can be written into, created if missing; checked when a setting or an
    output is given, so a bad one fails then and not after the work whose result it was to hold.
    ``name`` says what the folder is for in messages (``"dump_dir /x"``)."""
    folder = Path(text(str(path) if isinstance(path, Path) else path, name, error=error))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise error(f"cannot create {name}: a file is in the way of the folder {shown_path(folder)}") from None
    except OSError as exc:
        raise error(f"cannot create {name}: {exc.strerror or exc}; give a writable directory") from None
    if not folder.is_dir():
        raise error(f"cannot create {name}: a file is in the way of the folder {shown_path(folder)}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise error(f"cannot write into {name}: permission denied; give a writable directory")
    return folder


# -- documents ----------------------------------------------------------------------------------------
def read_text(path: str | Path, what: str, *, error: Error = ConfigError, max_bytes: int = MAX_DOCUMENT_BYTES,
              missing: str = "") -> str:
    """The UTF-8 text of ``path``, refusing missing, unreadable, oversized and binary files apart; a leading
    byte-order mark is dropped and CRLF / CR line ends read as LF, so a file saved on Windows reads as the same file.

    ``what`` names the file for people ("schedule file", "cost model"); ``missing``, where the file does not
    exist, says how one is made (a mistyped path or a file not made yet is a first run's likeliest mistake)."""
    path = file_path(path, what, error=error)
    what = f"{what} {shown_path(path)}"
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{what} is a directory; give a file")
        if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block or never end
            raise error(f"{what} is not a regular file (a pipe, socket or device); give a file")
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"cannot read {what}: it does not exist" + (f"; {missing}" if missing else "")) from None
    except PermissionError:
        raise error(f"cannot read {what}: permission denied (check its permissions)") from None
    except OSError as exc:
        raise error(f"cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise error(f"{what} is larger than {max_bytes // 2**20} MiB, more than any valid one; check the path")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is no content
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {exc.start}); is it the right file?") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # Windows and old Mac line ends read as one


def load_json(text: str, source: str, *, error: Error = ConfigError, constants: bool = False) -> Any:
    """Parse JSON strictly: no ``NaN``/``Infinity``, no number that overflows a float, no duplicate
    keys, at most :data:`MAX_DEPTH` deep. ``constants=True`` reads ``NaN``/``Infinity`` as floats, for a
    format whose writer (Python's json) spells a bad time so: the field's own check then names it."""
    def constant(word: str) -> Any:
        if constants:
            return float(word)
        raise ValueError(f"{word} is not a number (NaN and infinity are not allowed)")

    def finite(word: str) -> float:
        if not math.isfinite(x := float(word)):
            raise ValueError(f"{word} is too large for a number")
        return x

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"the key {key!r} appears twice in one object")
            out[key] = value
        return out

    try:
        data = json.loads(text, parse_constant=constant, parse_float=finite, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise error(f"{source} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise error(f"{source} is nested too deeply to be a primuspipe document") from None
    except ValueError as exc:  # the hooks above, or an integer with thousands of digits
        raise error(f"{source} is not valid JSON for primuspipe: {exc}") from None
    _check_depth(data, source, error)
    return data


class _StrictYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases (no alias bombs), without duplicate keys, and without the tags
    whose values no primuspipe field takes but a loose reader would misread (``!!binary aGk=`` is the bytes
    ``b"hi"``, which a per-stage list read as the times ``[104, 105]``)."""

    def _refuse_tag(self, node):  # noqa: ANN001 - PyYAML's signature
        raise yaml.constructor.ConstructorError(None, None, f"the tag {node.tag.replace(_YAML_TAG, '!!')} is not "
                                                "allowed in primuspipe files; write the value as a plain number, "
                                                "text, list or mapping", node.start_mark)

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in primuspipe files",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_object(self, node, deep=False):  # noqa: ANN001
        """A value its tag cannot build (``!!int 0.01``, ``!!bool 1``, ``!!timestamp x``, an integer of more
        than Python's 4,300 digits) is a YAML error at its line, not the ValueError/KeyError PyYAML lets out."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, LookupError, AttributeError, TypeError, OverflowError):
            tag = node.tag.replace(_YAML_TAG, "!!")
            raise yaml.constructor.ConstructorError(None, None, f"{show(node.value)} cannot be read as {tag}",
                                                    node.start_mark) from None

    def _decimal(self, node):  # noqa: ANN001 - PyYAML's signature
        """Refuse the YAML 1.1 number forms a YAML 1.2 reader (and a person) reads as another value: ``010`` is
        octal 8 to PyYAML but 10 to YAML 1.2 (and ``08`` is text, read as 8), ``1:30`` is sexagesimal 90."""
        value = self.construct_scalar(node)
        if _OCTAL_OR_SEXAGESIMAL.fullmatch(value.strip()):
            raise yaml.constructor.ConstructorError(None, None, f"{value!r} is a YAML 1.1 octal or base-60 number "
                                                    "that other YAML readers read otherwise; write it in decimal "
                                                    "without leading zeros or colons", node.start_mark)

    def construct_yaml_int(self, node):  # noqa: ANN001
        self._decimal(node)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):  # noqa: ANN001
        self._decimal(node)
        return super().construct_yaml_float(node)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen = []
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():  # !!map [1]: PyYAML says so
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice",
                                                        key_node.start_mark)
            seen.append(key)
        return super().construct_mapping(node, deep)


_YAML_TAG = "tag:yaml.org,2002:"
_OCTAL_OR_SEXAGESIMAL = re.compile(r"[-+]?(0[0-7_]+|[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?)", re.ASCII)
for _tag in ("binary", "set", "omap", "pairs"):
    _StrictYamlLoader.add_constructor(_YAML_TAG + _tag, _StrictYamlLoader._refuse_tag)
_StrictYamlLoader.add_constructor(_YAML_TAG + "int", _StrictYamlLoader.construct_yaml_int)
_StrictYamlLoader.add_constructor(_YAML_TAG + "float", _StrictYamlLoader.construct_yaml_float)


def load_yaml(text: str, source: str, *, error: Error = ConfigError) -> Any:
    """Parse YAML strictly: safe types only, no aliases, no duplicate keys, at most :data:`MAX_DEPTH` deep."""
    try:
        data = yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        where = f" at line {exc.problem_mark.line + 1}" if exc.problem_mark else ""
        tab = "; YAML indents with spaces, not tabs" if "'\\t'" in str(exc.problem) else ""
        raise error(f"{source} is not valid YAML{where}: {exc.problem}{tab}") from None
    except yaml.YAMLError as exc:
        raise error(f"{source} is not valid YAML: {exc}") from None
    except RecursionError:
        raise error(f"{source} is nested too deeply to be a primuspipe file") from None
    _check_depth(data, source, error)
    return data


def _check_depth(data: Any, source: str, error: Error) -> None:
    level = [data]
    for _ in range(MAX_DEPTH + 1):
        level = [v for item in level if isinstance(item, (list, dict))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return
    raise error(f"{source} is nested more than {MAX_DEPTH} levels deep, deeper than any primuspipe document")
