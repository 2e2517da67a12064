"""dump_pp_data's recorder driven as the runner drives it, with real work between its clock reads: CPU
stamps, message sizes and where the rank ran on CPU; on GPU, CUDA events per node read with one
synchronisation at the step's end, not one per node."""

import pytest
import torch

from primuspipe.algorithms.build import build_schedule
from primuspipe.runtime.recorder import StepRecorder

H = 64


def _step(device: torch.device):
    """Rank 0 of a pp=2 1F1B step with m=4: each compute node does a few matmuls between its clock
    reads, each SEND/RECV is recorded with its tensor. Returns ``(recorder, table)``."""
    table = build_schedule("1f1b", pp=2, microbatches=4)
    weight, tensor = torch.randn(H, H, device=device), torch.zeros(8, H, device=device)
    recorder = StepRecorder(device)
    for node in table.ranks[0]:
        start = recorder.clock()
        if node.kind.is_compute:
            x = torch.randn(8, H, device=device)
            for _ in range(20):
                x = torch.tanh(x @ weight)
        recorder.record(node, start, recorder.clock(), None if node.kind.is_compute else tensor)
    return recorder, table


def _check_order(timeline, table) -> None:
    (rank,) = timeline.ranks
    assert sorted(map(str, table.ranks[0])) == sorted(str(e.node) for e in rank.events)
    assert all(0 <= e.start <= e.end for e in rank.events)
    assert all(a.start <= b.start for a, b in zip(rank.events, rank.events[1:])), "sorted by start"
    assert all(e.bytes == (None if e.node.kind.is_compute else 8 * H * 4) for e in rank.events)


def test_cpu_dump_carries_cpu_stamps_and_where_the_rank_ran():
    recorder, table = _step(torch.device("cpu"))
    timeline = recorder.timeline(table, rank=0, iteration=3)
    _check_order(timeline, table)
    assert all(e.cpu is not None and 0 <= e.cpu[0] <= e.cpu[1] for e in timeline.ranks[0].events)
    assert {"host", "cpus", "threads", "thread_cpu", "process_cpu"} <= set(timeline.meta)
    assert timeline.meta["process_cpu"] > 0 and timeline.meta["thread_cpu"] > 0
    assert timeline.ranks[0].peak_memory_bytes > 0


@pytest.mark.gpu
def test_gpu_dump_synchronises_once_per_step_not_per_node(monkeypatch):
    """Recording a step records CUDA events and never waits for the device; building the timeline
    synchronises once and reads every event."""
    device = torch.device("cuda", torch.cuda.current_device())
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    recorder, table = _step(device)
    assert len(calls) == 1, "only the step start synchronises while the step runs"
    timeline = recorder.timeline(table, rank=0, iteration=0)
    assert len(calls) == 2, "reading the events synchronises once"
    _check_order(timeline, table)
    assert all(e.cpu is None for e in timeline.ranks[0].events), "GPU times are kernel times, no CPU stamps"
    assert timeline.meta["memory"] == "peak allocated"
