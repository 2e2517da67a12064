"""The shipped published-runs table (``bench/data/published_runs.yaml``), read once per test session.

The file is about 650 KB of YAML read through the strict (pure-Python) loader, seconds a read; twenty-odd tests
only look rows up in it. Rows are frozen dataclasses and no test edits their mappings (a changed row is a
``dataclasses.replace`` copy), so one read serves them all. A test of reading the file itself calls
``load_runs`` directly."""

import functools

from primuspipe.projection.published import PublishedRun, load_runs


@functools.cache
def shipped_runs() -> tuple[PublishedRun, ...]:
    """Every row of the shipped table, in file order."""
    return tuple(load_runs())
