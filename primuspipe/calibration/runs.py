"""Calibrating from several runs (dumps, sessions) of one table: which of them to trust.

The figures of a cost model are medians over iterations, which a few slow steps do not move. Runs are
another matter: on a shared host a whole run can meet a slow (or a free) moment -- another job, a
model whose memory landed badly -- and every one of its iterations is then off together. Pooled with
the other runs, such a run shifts every median by a share of its own offset, and the costs describe
no run at all. A run whose median step time lies far outside the other runs' is therefore a moment
of the host, not a cost of the schedule, and is left out (and said so, in the notes and
``MeasuredCosts.dropped_runs``).

"Far" is the modified z-score of Iglewicz and Hoaglin: a run is an outlier when
``0.6745 * |step - median| / MAD > 3.5`` over the runs' median step times (MAD: the median absolute
deviation from their median), a band that one or two odd runs cannot widen as they would a standard
deviation. Runs whose steps agree to a fraction of a percent have a MAD too small to mean anything
(timer and scheduling noise), so it is taken at least ``MIN_SPREAD`` of the median: no run within
about 5 % of the median is ever dropped. The rule needs at least three runs (with two, neither is the
odd one); at least half the runs always stay (half lie within one MAD of the median).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from primuspipe.errors import TableFormatError
from primuspipe.io.timeline import Timeline

Z_LIMIT = 3.5
"""Modified z-score beyond which a run is an outlier (Iglewicz and Hoaglin's recommendation)."""
MIN_SPREAD = 0.01
"""The MAD is taken at least this share of the median step: runs within ``Z_LIMIT / 0.6745 * MIN_SPREAD``
(5.2 %) of the median are never outliers."""
MIN_RUNS = 3
"""Fewest runs the rule judges: of two, neither is the odd one."""


def outliers(values: Sequence[float]) -> tuple[int, ...]:
    """Indices of the values outside the robust band (module docstring); none with fewer than
    ``MIN_RUNS`` values.

    >>> outliers([430.0, 418.0, 427.0, 421.0, 495.0])
    (4,)
    >>> outliers([430.0, 418.0, 427.0, 421.0, 445.0]), outliers([400.0, 600.0])
    ((), ())
    """
    if len(values) < MIN_RUNS:
        return ()
    middle = statistics.median(values)
    spread = max(statistics.median(abs(v - middle) for v in values), MIN_SPREAD * abs(middle))
    if spread == 0:
        return ()
    return tuple(i for i, v in enumerate(values) if 0.6745 * abs(v - middle) / spread > Z_LIMIT)


@dataclass(frozen=True)
class Screened:
    """Runs after their warm-up iterations are set aside and outlying runs dropped."""

    runs: tuple[tuple[Timeline, ...], ...]
    """The kept runs' iterations (after warm-up), oldest first, run by run."""
    steps: tuple[float, ...]
    """Every run's median step time (after warm-up), dropped ones included."""
    dropped: tuple[int, ...]
    """Indices of the runs left out."""
    notes: tuple[str, ...]

    @property
    def used(self) -> list[Timeline]:
        """Every kept iteration, run by run."""
        return [t for run in self.runs for t in run]


def screen_runs(runs: Sequence[Sequence[Timeline]], warmup: int, names: Sequence[str] | None = None) -> Screened:
    """Drop each run's first ``warmup`` iterations (all are kept where no more remain, and the notes say
    so), then the runs whose median step is an outlier among the runs' (:func:`outliers`). ``names`` (where
    each run was read from) name the runs whose shapes differ."""
    if not runs or not all(runs):
        raise TableFormatError("no timelines to measure; dump at least one iteration (dump_pp_data)")
    first = runs[0][0]
    shape = (first.algorithm, first.pp, first.vpp, first.microbatches, first.time_unit)
    for i, timelines in enumerate(runs):
        for t in timelines:
            if (t.algorithm, t.pp, t.vpp, t.microbatches, t.time_unit) != shape:
                which = f" ({names[i]} vs {names[0]})" if names else ""
                raise TableFormatError(f"timelines of different shapes cannot be measured together{which}: "
                                       f"{(t.algorithm, t.pp, t.vpp, t.microbatches, t.time_unit)} vs {shape} "
                                       "(algorithm, pp, vpp, microbatches, time unit); measure one table at a time")
    notes, kept_iterations = [], []
    for timelines in runs:
        used = tuple(timelines[warmup:])
        if not used:
            used = tuple(timelines)
            notes.append(f"only {len(timelines)} iteration(s), so no warm-up iteration was skipped: times may be high")
        kept_iterations.append(used)
    steps = tuple(statistics.median(t.step_time for t in run) for run in kept_iterations)
    dropped = outliers(steps)
    if dropped:
        middle = statistics.median(steps)
        which = ", ".join(f"run {i} ({steps[i]:.6g} {runs[i][0].time_unit}, {steps[i] / middle - 1:+.1%})" for i in dropped)
        notes.append(f"left out {which}: its median step lies outside the runs' robust band (modified z-score over "
                     f"{Z_LIMIT:g} around their median {middle:.6g}); a whole run that slow or fast met a moment "
                     "of the host, not the schedule's costs")
    return Screened(tuple(run for i, run in enumerate(kept_iterations) if i not in dropped), steps, dropped,
                    tuple(dict.fromkeys(notes)))
