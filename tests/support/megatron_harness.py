"""What the Megatron runner tests share: the pp=1 reference step, folding a case's per-rank results
into what that reference reports, and comparing named tensors.

Importing this needs megatron-core only when a reference actually runs.
"""

from __future__ import annotations

import functools

import torch

from primuspipe.testing.megatron import compare
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo


@functools.lru_cache(maxsize=None)
def pp1_references(keys: frozenset) -> dict:
    """Megatron's own pp=1 step (:class:`compare.StepResult`) for each ``(model, microbatches, train)``
    key, all in one gloo launch; ``train`` is DDP + finalize_model_grads + an SGD step. The reference
    where Megatron's pipelined schedules cannot run the shape or the chunk placement."""

    def work(ctx):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return {(model, m, train): compare.run_step(get_forward_backward_func(),
                                                    compare.StepSpec(model, m, ddp=train, optimizer_step=train), 1, 1)
                for model, m, train in keys}

    return run_on_gloo(work, ParallelLayout(1))[0]


def merged(results, case_id: str, run: str, attr: str) -> dict:
    """``attr`` (``"grads"`` or ``"params"``) of run ``run`` of case ``case_id``, folded over the ranks'
    ``{case_id: {run: StepResult}}`` results into one pp=1 model's names."""
    return compare.merge_ranks(getattr(rank[case_id][run], attr) for rank in results)


def stacked_losses(result: compare.StepResult) -> torch.Tensor:
    """The ``lm loss`` ``[loss_sum, num_tokens]`` of every microbatch, stacked."""
    return torch.stack([d["lm loss"] for d in result.losses])


def assert_same_tensors(got: dict, want: dict, what: str, *, bitwise: bool = False) -> None:
    """Same names, every value present and within 1e-6 (and bitwise equal with ``bitwise``)."""
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        assert got[name] is not None and want[name] is not None, f"{what}: {name} has no value"
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=f"{what} {name}")
        if bitwise:
            assert torch.equal(got[name], want[name]), f"{what}: {name} is close but not bitwise equal"
