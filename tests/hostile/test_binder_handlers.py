"""A user's binder (docs/backends.md: a map from node kind to handler, run by ``StepDriver``) that is not what the
runner needs: a map keyed by kind names (``"F"``) or numbers, a list, no map, a handler that is not callable, a
handler that returns None where the table hands its result to the next stage, a paired node's handler returning
one result for two parts.

Defects this family found: keys that are not ``NodeKind`` members were an AttributeError from the runner's own
refusal (``'str' object has no attribute 'name'``), a stray extra key was taken without a word, a handler of None
was "'NoneType' object is not callable", a handler returning None reached the binder's hand-off or the transport
(an AttributeError on this rank; its peer waited for the tensor until the watchdog), and a pair handler's missing
result was dropped by ``zip`` (the next stage's input never came). Each is one line naming the binder, the kind
or the node.

The step runs the reference binder in this process on a one-rank gloo group (a pp = 1 table of 2 chunks: every
hand-off between its stages goes through the runner as a transfer would)."""

import pytest
import torch
import torch.distributed as dist

from hostile_support import record, refused, run_in_step
from primuspipe.algorithms.build import build_schedule
from primuspipe.ir.node import NodeKind
from primuspipe.runtime.driver import StepDriver
from primuspipe.runtime.reference_binder import ModuleBinder

H = 4
M = 4


pytestmark = pytest.mark.usefixtures("one_rank_group")


def _binder(table):
    torch.manual_seed(0)
    return ModuleBinder([torch.nn.Linear(H, H) for _ in range(table.vpp)], num_stages=table.num_stages,
                        inputs=[torch.randn(2, H) for _ in range(table.microbatches)],
                        loss_fn=lambda y, mb: y.pow(2).mean(), transfer_shape=(2, H))


def _run(table, binder):
    StepDriver(watchdog_timeout_s=20).execute(table, 0, binder, dist.group.WORLD, device=torch.device("cpu"))


def _returns_none(handler):
    return lambda call: (handler(call), None)[1]


MAPS = [
    ("kind names as keys", lambda b: {"F": b.forward, "BW": b.backward}, ["'F'", "NodeKind"]),
    ("a stray kind name", lambda b: {**b.handlers, "X": b.forward}, ["'X'", "NodeKind"]),
    ("numbers as keys", lambda b: {0: b.forward, 1: b.backward}, ["key 0", "NodeKind"]),
    ("a send kind", lambda b: {**b.handlers, NodeKind.SEND_F: b.forward}, ["SEND_F", "compute"]),
    ("a list", lambda b: [b.forward, b.backward], ["handlers", "list"]),
    ("no map", lambda b: None, ["handlers", "NoneType"]),
    ("a handler of None", lambda b: {NodeKind.F: None, NodeKind.BW: b.backward}, ["NodeKind.F", "NoneType"]),
    ("a handler that is text", lambda b: {NodeKind.F: b.forward, NodeKind.BW: "backward"}, ["NodeKind.BW", "str"]),
    ("F returning None", lambda b: {NodeKind.F: _returns_none(b.forward), NodeKind.BW: b.backward},
     ["F handler returned None", "microbatch 0 of chunk 0", "stage 1"]),
    ("BW returning None", lambda b: {NodeKind.F: b.forward, NodeKind.BW: _returns_none(b.backward)},
     ["BW handler returned None", "chunk 1", "stage 0"]),
]


@pytest.mark.parametrize("case, handlers, names", MAPS, ids=[c for c, _, _ in MAPS])
def test_handler_maps(case, handlers, names):
    table = build_schedule("interleaved-1f1b", 1, M, 2)
    binder = _binder(table)
    binder.handlers = handlers(binder)
    refused(run_in_step(_run, table, binder), *names, case=f"binder: {case}")


def _pair_binder(table, pair):
    """The reference binder with ``B`` (its fused backward), a no-op ``W`` and ``pair`` for ``FB``."""
    binder = _binder(table)
    binder.handlers = {NodeKind.F: binder.forward, NodeKind.B: binder.backward, NodeKind.W: lambda call: None,
                       NodeKind.FB: pair(binder)}
    return binder


PAIRS = [("one result", lambda b: lambda call: (b.forward(call),), "1 result(s)"),
         ("three results", lambda b: lambda call: (*_both(b, call), None), "3 result(s)"),
         ("a tensor of two rows", lambda b: lambda call: _both(b, call) and torch.zeros(2, 2, H), "Tensor")]


def _both(binder, call):
    return binder.forward(call), binder.backward(call.partner)


@pytest.mark.parametrize("case, pair, named", PAIRS, ids=[c for c, _, _ in PAIRS])
def test_pair_handlers_returning_other_than_one_result_per_part(case, pair, named):
    """A missing result was dropped by ``zip`` (the next stage's input never came); a tensor's rows were taken as
    the parts' results."""
    table = build_schedule("dualpipe-v", 1, M)
    refused(run_in_step(_run, table, _pair_binder(table, pair)), named, "2 parts",
            case=f"binder: FB handler returning {case}")


def test_a_pair_handler_returning_both_runs_the_step():
    table = build_schedule("dualpipe-v", 1, M)
    binder = _pair_binder(table, lambda b: lambda call: _both(b, call))
    _run(table, binder)
    ok = sorted(binder.losses) == list(range(M))
    record("sound" if ok else "refused", "binder: FB handler returning one result per part")
    assert ok
