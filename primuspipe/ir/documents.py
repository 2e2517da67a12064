"""The envelope every primuspipe JSON document carries: a ``format`` name and a ``version``.

Schedules and timelines are exchanged as files between machines and versions of primuspipe; a reader
refuses a document that is not of its format or version before reading any field, so a wrong file is
one clear error rather than a confusing one later.
"""

from __future__ import annotations

from typing import Any

from primuspipe.errors import TableFormatError


def envelope(fmt: str, version: int) -> dict[str, Any]:
    """The first two fields of a document of ``fmt``."""
    return {"format": fmt, "version": version}


def check_envelope(data: Any, fmt: str, version: int, what: str) -> None:
    """Refuse ``data`` unless it is a mapping with ``format == fmt`` and ``version == version``."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise TableFormatError(f"not a primuspipe {what}: the JSON lacks format='{fmt}'")
    if data.get("version") != version:
        raise TableFormatError(f"{what} JSON version {data.get('version')!r} is not supported (want {version})")
