"""Readers and writers of schedule tables and timelines: the file formats around the IR.

:mod:`~primuspipe.io.formats` reads and writes tables (primuspipe JSON, torch.distributed.pipelining CSV and
Primus's printed table, :mod:`~primuspipe.io.primus_format`); :mod:`~primuspipe.io.timeline` is the timeline
document the simulator writes and real runs dump, :mod:`~primuspipe.io.run_dumps` a run's per-rank dumps merged
into one step, and :mod:`~primuspipe.io.timeline_wiring` a timeline's events met with the table's wiring. The checks every value from outside passes
(:mod:`primuspipe.strict`) and the document envelope (:mod:`primuspipe.documents`) sit below the IR, since the
IR's own ``from_dict`` applies them.
"""
