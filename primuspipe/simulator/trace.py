"""Chrome / Perfetto trace export of a timeline (simulated or measured).

Layout: one process (pid 0) with one track (tid) per rank; each compute node is a complete event
(``"ph": "X"``, ``ts``/``dur`` in microseconds) named by its text form (``F3.1``); each cross-rank
hand-off is a flow arrow (``"ph": "s"`` inside the producing slice, ``"ph": "f"`` with ``"bp": "e"`` at
the start of the consuming slice, one ``id`` per transfer). When the timeline has the SEND/RECV nodes,
the flow's ``args`` carry when the send and the receive were posted and when the tensor arrived.
Open the file at https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from pathlib import Path

from primuspipe.ir.dataflow import Transfer, inbound, outbound, transfer_of
from primuspipe.documents import output_file, write_atomically
from primuspipe.errors import TableFormatError
from primuspipe.ir.kinds import NodeKind
from primuspipe.ir.placement import Placement
from primuspipe.ir.cost_model import TIME_UNITS
from primuspipe.io.timeline import TimedNode, Timeline

_PID = 0


def chrome_trace(timeline: Timeline, placement: Placement) -> dict:
    """The trace as a JSON-ready dict (``{"traceEvents": [...], ...}``)."""
    if timeline.time_unit not in TIME_UNITS:
        raise TableFormatError(f"timeline time_unit {timeline.time_unit!r} is not one of {sorted(TIME_UNITS)}")
    scale = TIME_UNITS[timeline.time_unit]
    title = (f"{timeline.algorithm} pp={timeline.pp} vpp={timeline.vpp} microbatches={timeline.microbatches} "
             f"({timeline.source})")
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": _PID, "tid": 0, "args": {"name": title}}]
    producers: dict[Transfer, tuple[int, TimedNode]] = {}
    consumers: dict[Transfer, tuple[int, TimedNode]] = {}
    for rt in timeline.ranks:
        rank = rt.rank
        events += [{"ph": "M", "name": "thread_name", "pid": _PID, "tid": rank, "args": {"name": f"rank {rank}"}},
                   {"ph": "M", "name": "thread_sort_index", "pid": _PID, "tid": rank, "args": {"sort_index": rank}}]
        for e in rt.events:
            node = e.node
            if not node.kind.is_compute:
                continue
            events.append({"ph": "X", "name": str(node), "cat": node.kind.name, "pid": _PID, "tid": rank,
                           "ts": e.start * scale, "dur": (e.end - e.start) * scale,
                           "args": {"microbatch": node.microbatch, "chunk": node.chunk,
                                    "stage": placement.stage(rank, node.chunk)}})
            for kind, mb, chunk in node.parts():
                if (t := outbound(placement, rank, kind, chunk, mb)) is not None:
                    producers[t] = (rank, e)
                if (t := inbound(placement, rank, kind, chunk, mb)) is not None:
                    consumers[t] = (rank, e)
    matched = matched_transfers(timeline, placement)
    flows = sorted((p[1].start, p[0], t) for t, p in producers.items() if t in consumers)
    for flow_id, (_, src, t) in enumerate(flows):
        (_, made), (dst, used) = producers[t], consumers[t]
        args = {"transfer": str(t)}
        if t in matched:
            send, recv = matched[t]
            args.update(send_posted=send.start, recv_posted=recv.start, arrived=recv.end)
        name = "activation" if t.carries is NodeKind.F else "gradient"
        events += [
            {"ph": "s", "id": flow_id, "name": name, "cat": "p2p", "pid": _PID, "tid": src,
             "ts": (made.start + made.end) / 2 * scale, "args": args},
            {"ph": "f", "bp": "e", "id": flow_id, "name": name, "cat": "p2p", "pid": _PID, "tid": dst,
             "ts": used.start * scale},
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": timeline.source, "algorithm": timeline.algorithm, "time_unit": timeline.time_unit}}


def matched_transfers(timeline: Timeline, placement: Placement) -> dict[Transfer, tuple[TimedNode, TimedNode]]:
    """Each transfer whose send and receive are both in the timeline, as ``(send, receive)`` events: a
    send's ``start`` is when it was posted, a receive's ``start`` and ``end`` when it was posted and
    when the tensor arrived. Timelines without SEND/RECV nodes give an empty mapping."""
    posted: dict[tuple[Transfer, bool], TimedNode] = {
        (transfer_of(placement, rt.rank, e.node), e.node.kind.is_send): e
        for rt in timeline.ranks for e in rt.events if not e.node.kind.is_compute
    }
    return {t: (send, posted[(t, False)]) for (t, is_send), send in posted.items()
            if is_send and (t, False) in posted}


def write_chrome_trace(path: str | Path, timeline: Timeline, placement: Placement) -> Path:
    return write_atomically(output_file(path, "trace file", writes="JSON"),
                            json.dumps(chrome_trace(timeline, placement)))
