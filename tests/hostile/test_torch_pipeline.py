"""``TorchPipeline`` given what it cannot run: objects of the wrong type, stages that are not the table's,
a watchdog of NaN or below zero, a switch given as text (``scale_grads="no"``
was kept, and is truthy), op names given as one string (read as its characters), a device or a group torch cannot
use (its RuntimeError, ValueError), a dump folder that cannot be written, a batch that does not split into
the table's microbatches (which returned extra rows of garbage from ``eval``), a ``loss_fn`` that returns no loss a
backward can start from (None, a float, a tuple, a loss per element, a detached loss: an AttributeError in the binder or
torch's error from inside the backward). Each is one PrimusPipeError naming the argument, at construction or before
the step runs a node (``late`` otherwise) -- the loss function's result when the step computes it.

The pipeline runs in this process on a one-rank gloo group (a pp = 1 table, 2 chunks interleaved)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile_support import record, refused, run_api, run_in_step
from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.torch import TorchPipeline

H = 4
M = 4


pytestmark = pytest.mark.usefixtures("one_rank_group")


def _table():
    return build_schedule("interleaved-1f1b", 1, M, 2)


def _stages(n=2):
    torch.manual_seed(0)
    return {s: torch.nn.Linear(H, H) for s in range(n)}


LOSS = torch.nn.functional.mse_loss


@pytest.mark.parametrize("args, kwargs, names", [
    (({"pp": 1}, None), {}, ["table", "dict"]),
    ((None, None), {}, ["table"]),
    (("TABLE", [torch.nn.Linear(H, H)] * 2), {}, ["stages"]),
    (("TABLE", {0: "layer", 1: "layer"}), {}, ["stages"]),
    (("TABLE", {0: torch.nn.Linear(H, H)}), {}, ["stages [0, 1]"]),
    (("TABLE", {0: torch.nn.Linear(H, H), 1: torch.nn.Linear(H, H), 2: torch.nn.Linear(H, H)}), {}, ["stage"]),
    (("TABLE", {0: torch.nn.Linear(H, H), 5: torch.nn.Linear(H, H)}), {}, ["stage"]),
    (("TABLE", {0.0: torch.nn.Linear(H, H), 1: torch.nn.Linear(H, H)}), {}, ["stage"]),
    (("TABLE", "STAGES"), {"watchdog_timeout_s": float("nan")}, ["watchdog_timeout_s"]),
    (("TABLE", "STAGES"), {"watchdog_timeout_s": -1.0}, ["watchdog_timeout_s"]),
    (("TABLE", "STAGES"), {"watchdog_timeout_s": 0}, ["watchdog_timeout_s"]),
    (("TABLE", "STAGES"), {"watchdog_timeout_s": float("inf")}, ["watchdog_timeout_s"]),
    (("TABLE", "STAGES"), {"watchdog_timeout_s": "soon"}, ["watchdog_timeout_s"]),
    (("TABLE", "STAGES"), {"loss_fn": "mse"}, ["loss_fn"]),
    (("TABLE", "STAGES"), {"dump_dir": ""}, ["dump_dir"]),
    *[(("TABLE", "STAGES"), {switch: value}, [switch]) for switch in ("scale_grads", "count_saved_bytes")
      for value in ("no", "false", None, 0, 2, float("nan"))],
    *[(("TABLE", "STAGES"), {"offload_ops": ops}, ["offload_ops"]) for ops in ("attn", 5, ["attn", 3], [""], None)],
    *[(("TABLE", "STAGES"), {"device": device}, ["device"]) for device in ("nonsense", "cuda:99", 99, 1.5, "")],
    *[(("TABLE", "STAGES"), {"group": group}, ["group"]) for group in ("x", 0, "WORLD")],
])
def test_construction(args, kwargs, names):
    table, stages = args
    table = _table() if table == "TABLE" else table
    stages = _stages() if stages == "STAGES" else stages
    refused(run_api(TorchPipeline, table, stages, **kwargs), *names, case=f"TorchPipeline {args} {kwargs}")


def test_dump_dir_that_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    for where in (tmp_path / "file", tmp_path / "file" / "below"):
        refused(run_api(TorchPipeline, _table(), _stages(), loss_fn=LOSS, dump_dir=str(where)), "dump_dir",
                case=f"TorchPipeline dump_dir {where.name}")


def test_numpy_stage_numbers_are_stage_numbers():
    pipe = TorchPipeline(_table(), {np.int64(s): m for s, m in _stages().items()}, loss_fn=LOSS)
    losses = pipe.step(torch.randn(2 * M, H), target=torch.randn(2 * M, H))
    record("sound" if len(losses) == M else "refused", "TorchPipeline numpy stage numbers")
    assert len(losses) == M


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40).filter(lambda n: n % M), st.sampled_from(["step", "eval"]))
def test_batches_that_do_not_split(batch, call):
    """A batch of n rows, n not a multiple of m: refused before any node runs (eval returned extra rows)."""
    pipe = TorchPipeline(_table(), _stages(), loss_fn=LOSS)
    x = torch.randn(batch, H)
    outcome = refused(run_api(getattr(pipe, call), x, target=torch.randn(batch, H)), "batch",
                      case=f"TorchPipeline.{call} batch {batch} into {M}")
    assert outcome.kind == "clear"


@pytest.mark.parametrize("inputs, target, names", [
    ((torch.randn(8, H),), torch.randn(12, H), ["target"]),
    ((torch.randn(8, H), torch.randn(4, H)), torch.randn(8, H), ["different sizes"]),
    (([[1.0] * H] * 8,), torch.randn(8, H), ["tensors"]),
    ((torch.tensor(1.0),), torch.randn(8, H), ["batch"]),
    ((), torch.randn(8, H), ["inputs"]),
])
def test_bad_step_arguments(inputs, target, names):
    pipe = TorchPipeline(_table(), _stages(), loss_fn=LOSS)
    refused(run_api(pipe.step, *inputs, target=target), *names, case=f"TorchPipeline.step {names[0]}")


LOSSES = [
    ("None", lambda output, target: None, ["loss_fn", "NoneType"]),
    ("a float", lambda output, target: 1.0, ["loss_fn", "float"]),
    ("a tuple", lambda output, target: (LOSS(output, target), 1), ["loss_fn", "tuple"]),
    ("a loss per element", lambda output, target: (output - target) ** 2, ["loss_fn", "shape (2, 4)"]),
    ("a detached loss", lambda output, target: LOSS(output, target).detach(), ["loss_fn", "no gradient"]),
    ("a constant", lambda output, target: torch.tensor(3.0), ["loss_fn", "no gradient"]),
]


@pytest.mark.parametrize("algorithm", ["interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("case, loss_fn, names", LOSSES, ids=[c for c, _, _ in LOSSES])
def test_loss_functions_that_return_no_loss(case, loss_fn, names, algorithm):
    """A loss_fn whose result a step cannot run its backward from: an AttributeError in the binder, or torch's
    "grad can be implicitly created only for scalar outputs" / "does not require grad" from inside the backward
    (a split backward's "cannot get the gradient edge"). One line naming loss_fn and the microbatch."""
    pipe = TorchPipeline(build_schedule(algorithm, 1, M, 2), _stages(), loss_fn=loss_fn)
    refused(run_in_step(pipe.step, torch.randn(8, H), target=torch.randn(8, H)), *names, "microbatch 0",
            case=f"TorchPipeline {algorithm} loss_fn returning {case}")


def test_eval_takes_a_loss_per_element_but_not_none():
    """eval runs no backward: a loss of any shape is what the caller asked for; None is still no loss."""
    elementwise = TorchPipeline(_table(), _stages(), loss_fn=lambda output, target: (output - target) ** 2)
    losses = elementwise.eval(torch.randn(8, H), target=torch.randn(8, H)).losses
    ok = [tuple(x.shape) for x in losses] == [(2, H)] * M
    record("sound" if ok else "refused", "TorchPipeline.eval loss per element")
    assert ok
    pipe = TorchPipeline(_table(), _stages(), loss_fn=lambda output, target: None)
    refused(run_in_step(pipe.eval, torch.randn(8, H), target=torch.randn(8, H)), "loss_fn", "NoneType",
            case="TorchPipeline.eval loss_fn returning None")


@pytest.mark.parametrize("stages, inputs", [
    ({0: torch.nn.Linear(H, 2 * H), 1: torch.nn.Linear(H, H)}, (torch.randn(8, H),)),
    ({0: torch.nn.Linear(H, H), 1: torch.nn.Linear(H, H)}, (torch.randn(8, 2 * H),)),
    ({0: torch.nn.Linear(H, H), 1: torch.nn.Linear(H, H)}, (torch.randn(8, H), torch.randn(8, H))),
    ({0: torch.nn.Linear(H, H), 1: torch.nn.Linear(H, H)}, (torch.randint(0, 3, (8, H)),)),
])
def test_stages_that_do_not_chain(stages, inputs):
    """Modules that cannot take what the step or the stage before gives them: one line before any node."""
    pipe = TorchPipeline(_table(), stages, loss_fn=LOSS)
    refused(run_api(pipe.step, *inputs, target=torch.randn(8, H)), "stage", case="TorchPipeline stages do not chain")


def test_a_whole_batch_still_runs_and_eval_returns_its_rows():
    pipe = TorchPipeline(_table(), _stages(), loss_fn=LOSS)
    out = pipe.eval(torch.randn(2 * M, H))
    record("sound" if out.output.shape == (2 * M, H) else "refused", "TorchPipeline.eval whole batch")
    assert out.output.shape == (2 * M, H)
