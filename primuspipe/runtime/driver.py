"""The backend-neutral part of a training step: which table, which view of it, and how it runs.

A backend (Megatron's ``get_forward_backward_func`` replacement, the plain-torch stage runner) owns
its model and its binder; everything around running a table is here, once:

* tables are built and validated once per (algorithm, shape, options) and cached (immutable values);
* ``forward_only`` runs the table's forward-only view (:mod:`primuspipe.passes.forward_only`);
* one :class:`~primuspipe.runtime.runner.ScheduleRunner` per (table, rank);
* before a table's first step on a process group, every rank checks that all ranks hold the same table
  (:func:`check_same_table`: a digest of it, gathered once per table and group), so ranks that built
  different tables — another algorithm, other options, a search that ended elsewhere — refuse with a
  clear error instead of hanging or training on mismatched halves;
* :func:`last_backwards`: per chunk, the microbatch of its last weight-gradient node on a rank (where a
  backend may start gradient synchronisation);
* the point-to-point transport with its hang watchdog, and, when dumping, the
  :class:`~primuspipe.runtime.recorder.StepRecorder` whose timeline is written per rank and iteration.

A minimal backend is a binder plus ``StepDriver(...).execute(...)``: see docs/backends.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from primuspipe.algorithms.build import build_schedule
from primuspipe.errors import ConfigError, TableMismatchError
from primuspipe import strict
from primuspipe.ir.table import ScheduleTable
from primuspipe.io.timeline import Timeline, dump_path
from primuspipe.passes.forward_only import forward_only_view
from primuspipe.runtime.protocols import Binder
from primuspipe.runtime.runner import cached_runner


@strict.arguments()
def cached_schedule(algorithm: str, pp: int, vpp: int | None, microbatches: int,
                    options: tuple[tuple[str, Any], ...] = ()) -> ScheduleTable:
    """The validated full table for a shape, built once (``options`` as sorted ``(name, value)`` pairs; a list of
    pairs, or a value that cannot be hashed, was the cache's TypeError)."""
    for name, value in options:
        try:
            hash(value)
        except TypeError:
            raise ConfigError(f"cached_schedule's option {name}={strict.show(value)} cannot key the cache; give a "
                              "number, text or tuple") from None
    return _cached_schedule(algorithm, pp, vpp, microbatches, options)


@functools.lru_cache(maxsize=64)
def _cached_schedule(algorithm: str, pp: int, vpp: int | None, microbatches: int,
                     options: tuple[tuple[str, Any], ...]) -> ScheduleTable:
    return build_schedule(algorithm, pp, microbatches, vpp, **dict(options))


@functools.lru_cache(maxsize=64)
def last_backwards(table: ScheduleTable, rank: int) -> Mapping[int, int]:
    """chunk -> microbatch of its last node completing a weight gradient (``BW``/``W``) on ``rank``."""
    last: dict[int, int] = {}
    for node in table.ranks[rank]:
        for kind, mb, chunk in node.parts():
            if kind.is_weight_grad:
                last[chunk] = mb
    return MappingProxyType(last)


def table_digest(table: ScheduleTable) -> str:
    """sha256 of the table's JSON form: its algorithm, shape, placement and every rank's nodes (not its
    informational construction record, which a table read from an older file lacks)."""
    identity = {k: v for k, v in table.to_dict().items() if k != "construction"}
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()


def check_same_table(table: ScheduleTable, rank: int, group: Any) -> None:
    """Raise :class:`TableMismatchError` on every rank unless all ranks of ``group`` hold ``table``.

    One ``all_gather_object`` of (digest, algorithm, shape) per call; every rank sees every digest, so
    all of them refuse together, naming rank 0 and the first rank that differs, before any node runs."""
    import torch.distributed as dist

    mine = (table_digest(table), table.algorithm, table.pp, table.vpp, table.microbatches)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for other, theirs in enumerate(everyone):
        if theirs[0] != everyone[0][0]:
            raise TableMismatchError(
                f"the pipeline's ranks hold different schedule tables: {_holding(0, everyone[0])}, but "
                f"{_holding(other, theirs)} (this is rank {rank}); nothing was run. Give every rank the same "
                "algorithm, options and cost model (or build the table on one rank and send it to the others)")


def _holding(rank: int, entry: tuple) -> str:
    digest, algorithm, pp, vpp, m = entry
    return f"rank {rank} holds {algorithm!r} (pp={pp}, vpp={vpp}, {m} microbatches, sha256 {digest[:16]})"


MAX_TIMEOUT_S = 1e9
"""Largest watchdog timeout (about 32 years; 0 turns the watchdog off): a transfer's deadline becomes a
``timedelta`` and a C timeout, which 1e15 s overflows -- at the first transfer of every rank, after the
setting was accepted."""


class StepDriver:
    """Runs one rank's row of a table per step, with the transport, watchdog and dumps configured once."""

    def __init__(self, *, watchdog_timeout_s: float, dump_dir: str | None = None):
        # checked now, not after the first step whose timeline they were to hold (every backend builds one)
        self.watchdog_timeout_s = strict.number(watchdog_timeout_s, "watchdog_timeout_s", above=0,
                                                maximum=MAX_TIMEOUT_S)
        self.dump_dir = None if dump_dir is None else str(strict.writable_folder(dump_dir, f"dump_dir {dump_dir}"))
        """Where each training step's timeline goes (``None``: no dumps)."""
        self.iteration = 0
        """Training (not forward-only) steps run so far: the iteration number of dumps."""
        self.run_id: str | None = None
        """The run id every dump of this run carries (agreed by the pipeline's ranks at the first dump)."""
        self._agreed: dict[tuple[int, int], tuple[ScheduleTable, Any]] = {}
        """(id of table, id of group) -> both, once every rank of the group was seen to hold the table."""

    @staticmethod
    def view(table: ScheduleTable, forward_only: bool) -> ScheduleTable:
        """What a step runs: the table, or its forward-only view."""
        return forward_only_view(table) if forward_only else table

    @strict.arguments()
    def execute(self, table: ScheduleTable, rank: int, binder: Binder, group: Any, *, device: Any,
                forward_only: bool = False, record: bool = False,
                dump_meta: Mapping[str, Any] | None = None) -> Timeline | None:
        """Run ``rank``'s row of ``table`` (already :meth:`view`-ed) over ``group``; dump its timeline
        when dumping and training (with ``dump_meta`` added to its ``meta``). Returns the step's timeline
        when one was recorded: when dumping, or when ``record`` (the in-flight re-planner measures steps
        with the recorder dumps use, dumping or not)."""
        import torch.distributed as dist

        from primuspipe.runtime.recorder import StepRecorder, checked_device, shared_run_id
        from primuspipe.runtime.transport import P2PTransport

        if not isinstance(group, dist.ProcessGroup):  # None or a name was torch's ValueError at the first transfer
            raise ConfigError(f"execute's group must be a torch.distributed ProcessGroup (dist.group.WORLD, "
                              f"dist.new_group(...)), got {strict.show(group)}")
        device = checked_device(device, "execute's device")

        runner = cached_runner(table, rank)  # proves an unproven table first: nothing runs or talks before
        key = (id(table), id(group))
        if key not in self._agreed:  # steady-state steps pay nothing
            check_same_table(table, rank, group)
            self._agreed[key] = (table, group)  # held, so the ids stay theirs
        recorder = None
        dumping = self.dump_dir is not None and not forward_only
        if dumping or (record and not forward_only):
            if dumping:
                self.run_id = self.run_id or shared_run_id(group)
            recorder = StepRecorder(device, self.run_id)
        transport = P2PTransport(group, timeout_s=self.watchdog_timeout_s)
        timing = getattr(binder, "timing_layers", None)  # optional (protocols.Binder): spans inside the layers
        with timing(recorder) if timing is not None and recorder is not None else contextlib.nullcontext():
            runner.run(binder, transport, recorder)
        timeline = None
        if recorder is not None:
            timeline = recorder.timeline(table, rank, self.iteration)
            if dumping:
                if dump_meta:
                    timeline = replace(timeline, meta={**timeline.meta, **dump_meta})
                timeline.save(dump_path(self.dump_dir, self.iteration, rank))
        if not forward_only:
            self.iteration += 1
        return timeline
