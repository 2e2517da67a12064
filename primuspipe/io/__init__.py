"""Readers and writers of schedule tables and timelines: the file formats around the IR.

:mod:`~primuspipe.io.formats` reads and writes tables (primuspipe JSON, torch.distributed.pipelining CSV and
Primus's printed table, :mod:`~primuspipe.io.primus_format`); :mod:`~primuspipe.io.timeline` is the timeline
document the simulator writes and real runs dump. The checks every value from outside passes
(:mod:`primuspipe.strict`) and the document envelope (:mod:`primuspipe.documents`) sit below the IR, since the
IR's own ``from_dict`` applies them.
"""
