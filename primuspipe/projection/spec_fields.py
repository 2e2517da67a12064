"""Reading the projection's YAML inputs into typed specs, with errors that say where and how to fix.

The three inputs (model, training, hardware) are frozen dataclasses whose fields carry Megatron's names
and a docstring each. :func:`spec_from_mapping` checks a YAML mapping against such a class: no unknown
keys (with a "did you mean"), every value of its field's type -- integers integral, numbers finite and
non-negative (they are sizes, rates and fractions), booleans real booleans -- and reports the first
problem as one :class:`InputError` naming the file, the field and the fix. Checks that need several
fields (heads divisible by TP, ...) live with the specs and raise the same error.
"""

from __future__ import annotations

import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from primuspipe.projection.framework import ConfigError, strict

T = TypeVar("T")


class InputError(ConfigError):
    """A projection input is missing, malformed or inconsistent.

    ``places`` are ``(source, field, value)`` triples; the message names each, then the problem and the
    fix, on one line::

        llama.yaml: num_attention_heads=30 and train.yaml: tensor_model_parallel_size=4: ...; ...
    """

    def __init__(self, places: list[tuple[str, str, Any]], problem: str, fix: str):
        where = " and ".join(f"{source}: {name}={value!r}" for source, name, value in places)
        super().__init__(f"{where}: {problem}; {fix}")
        self.places = places


_SHIPPED = {what: f"the shipped {what} files are examples/projection/{folder}/*.yaml (e.g. --{what} "
                  f"examples/projection/{folder}/{example}.yaml)"
            for what, folder, example in (("model", "models", "llama3-8b"), ("hardware", "hardware", "h100"),
                                          ("training", "training", "default"))}
"""What a missing model, hardware or training file's error adds: where the repository's own files are."""


def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """The mapping at the top of a YAML file (``what`` names the input in errors), read strictly: bounded
    size and nesting, no aliases (no alias bomb), no duplicate keys (:mod:`primuspipe.strict`)."""
    data = strict.load_yaml(strict.read_text(path, f"the {what} file", missing=_SHIPPED.get(what, "")),
                            f"the {what} file {path}")
    if not isinstance(data, Mapping):
        raise ConfigError(f"the {what} file {path} must hold a mapping of fields, got {type(data).__name__}")
    return dict(data)


def spec_from_mapping(cls: type[T], data: Mapping[str, Any], source: str) -> T:
    """An instance of the dataclass ``cls`` from ``data``; missing fields take their defaults.

    ``cls`` must have a ``source`` field (where the values came from, for later error messages).
    """
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls) if f.name != "source"]
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(sorted(known))}"
            raise InputError([(source, str(key), value)], "unknown field", fix)
        values[key] = coerce(hints[key], value, source, key)
    required = [f.name for f in fields(cls) if f.name not in values
                and f.default is MISSING and f.default_factory is MISSING]
    if required:
        raise InputError([(source, name, None) for name in required], "required field missing",
                         "add it to the file")
    return cls(**values, source=source)


def coerce(hint: Any, value: Any, source: str, name: str, *, text_numbers: bool = True) -> Any:
    """``value`` as the annotated type, or an :class:`InputError` naming the field; ``text_numbers``: a number
    may be written as text (PyYAML reads ``1.0e9`` as a string)."""
    try:
        return _coerce(hint, value, text_numbers)
    except (TypeError, ValueError) as exc:
        raise InputError([(source, name, value)], str(exc), f"give {_describe(hint)}") from None


def check_fields(spec: Any) -> None:
    """Every field of the spec ``spec`` (a dataclass with a ``source``) checked by the rules its file is read by
    -- whole numbers integral, numbers finite and >= 0, flags real booleans, names printable, choices among their
    values -- and kept as the type it reads as (an int for a float field, a list as a tuple): a spec built in code
    passed only its cross-field checks, so ``TrainingSpec(micro_batch_size=0.5)``, ``sequence_parallel="yes"`` or
    ``precision="fp64"`` projected without a word, and ``HardwareSpec(hbm_bytes="80e9")`` was a TypeError. Numbers
    as text, which only a YAML reader makes, are refused here: the loader has read them already."""
    source = getattr(spec, "source", type(spec).__name__)
    for name, hint, plain in _field_checks(type(spec)):
        value = getattr(spec, name)
        if not any(check(value) for check in plain):  # the common case, without coerce's walk (projection's search)
            conformed = coerce(hint, value, source, name, text_numbers=False)
            if conformed is not value:
                object.__setattr__(spec, name, conformed)


_PLAIN: dict[Any, Any] = {int: lambda v: type(v) is int and v >= 0, bool: lambda v: type(v) is bool,
                          float: lambda v: type(v) is float and 0 <= v < math.inf, type(None): lambda v: v is None}
"""Values that are already what :func:`coerce` would make of them, by annotation: accepted at a glance."""


@functools.cache
def _field_checks(cls: type) -> tuple[tuple[str, Any, tuple[Any, ...]], ...]:
    """Each field of ``cls`` but ``source`` (where the values came from: a path, printed escaped where named) with
    its annotation and the glances (:data:`_PLAIN`) its values pass by."""
    hints = typing.get_type_hints(cls)
    checks = []
    for field in fields(cls):
        if field.name != "source":
            hint = hints[field.name]
            members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
            checks.append((field.name, hint, tuple(_PLAIN[m] for m in members if m in _PLAIN)))
    return tuple(checks)


def _coerce(hint: Any, value: Any, text_numbers: bool = True) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        for arg in kinds:
            try:
                return _coerce(arg, value, text_numbers)
            except (TypeError, ValueError):
                if len(kinds) == 1:  # one kind of value (or null): its own problem says more
                    raise
                continue
        raise ValueError("not a valid value")
    if origin is Literal:
        if value not in args or isinstance(value, bool) and not any(isinstance(a, bool) for a in args):
            raise ValueError(f"not one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError("not a list")
        return tuple(_coerce(args[0], v, text_numbers) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise TypeError("not a mapping")
        return {_coerce(args[0], key, text_numbers): _nested(key, args[1], item, text_numbers)
                for key, item in value.items()}
    if is_dataclass(hint) and isinstance(value, hint):  # built in code: checked by its own construction
        return value
    if is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise TypeError("not a mapping")
        hints = typing.get_type_hints(hint)
        names = [f.name for f in fields(hint)]
        unknown = [str(key) for key in value if key not in names]
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (known: {', '.join(names)})")
        missing = [f.name for f in fields(hint) if f.name not in value and f.default is MISSING]
        if missing:
            raise ValueError(f"field {missing[0]!r} missing")
        return hint(**{key: _nested(key, hints[key], item, text_numbers) for key, item in value.items()})
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise TypeError("not a boolean")
    if hint in (int, float) and isinstance(value, str) and not text_numbers:
        raise TypeError("text, not a number")
    if hint is int:
        return _count(value)
    if hint is float:
        return _number(value)
    if hint is str:
        if not isinstance(value, str) or not value:
            raise TypeError("not a non-empty string")
        if not value.isprintable():  # a name is printed back in the report (strict.text's rule)
            raise ValueError("not printable text on one line (a control or format character)")
        return value
    raise AssertionError(f"spec field type {hint!r} has no reader")


def _nested(key: Any, hint: Any, value: Any, text_numbers: bool = True) -> Any:
    """``value`` as ``hint`` inside a mapping: a problem names its ``key``."""
    try:
        return _coerce(hint, value, text_numbers)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{key}: {exc}") from None


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("a boolean is not a number")
    if isinstance(value, str) and not strict.NUMBER_TEXT.fullmatch(value):
        raise TypeError("not a number")
    try:  # numeric strings too: PyYAML reads 1.0e9 (no exponent sign) as a string
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError("not a number") from None
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    if number < 0:
        raise ValueError("negative")
    return number


def _count(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):  # exact: a float holds 53 bits
        if value < 0:
            raise ValueError("negative")
        return value
    number = _number(value)
    if number != int(number):
        raise ValueError("not a whole number")
    return int(number)


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is tuple:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a mapping of names, each to {_describe(args[1])}"
    if is_dataclass(hint):
        return f"a mapping with {', '.join(f.name for f in fields(hint))}"
    return {bool: "true or false", int: "a whole number >= 0", float: "a finite number >= 0", str: "a name",
            type(None): "null"}[hint]


def oversized(spec: Any, default: int, maxima: Mapping[str, int]) -> tuple[str, int] | None:
    """The first whole-number field of ``spec`` (a list's entries too) above its bound -- ``maxima[name]``,
    else ``default`` -- as ``(name, bound)``; None when all are within. Every whole number a spec holds is
    a size or a count the projection multiplies or keeps a list entry per unit of, so a bound on each
    (not only on the fields someone listed) keeps its arithmetic finite and its lists small."""
    for field in fields(spec):
        value = getattr(spec, field.name)
        for v in value if isinstance(value, tuple) else (value,):
            bound = maxima.get(field.name, default)
            if isinstance(v, int) and not isinstance(v, bool) and v > bound:
                return field.name, bound
    return None
