"""A chunk's fixed cost, measured on real megatron-core training (CPU, gloo) and carried to other shapes.

One gloo launch (pp = 2) trains, a step of each in turn, 1F1B with its split probe at m = 4 and two
vpp = 2 tables at a microbatch count the 1F1B run did not use (interleaved-1f1b and ZBV at m = 6), all
dumping (``dump_pp_data``). Checked:

* the dumps time each compute node's part in the decoder (``layers``) and the first stage's embedding
  (``ends``: its forward and its backward), within the node, and timing them changes no gradient
  (bitwise, the same step with and without dumping);
* calibrated from the 1F1B dumps alone, the file with the fixed parts (``compute.fixed`` /
  ``compute.chunk``) predicts the vpp = 2 runs' node times per model stage closer than the same file
  cut evenly (the model stage of the loss head is on rank 1 for interleaved and on rank 0 for ZBV).

At tiny-gpt's size (hidden 16) a node is mostly fixed cost, so the even cut misses each chunk's by
a wide margin; node times, not steps, are compared, so other jobs on the host move both models alike.
"""

import functools
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")]

from primuspipe.algorithms import get_algorithm  # noqa: E402
from primuspipe.backends.megatron.config import PrimusPipeConfig  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.calibration.measure import measure_costs  # noqa: E402
from primuspipe.ir.cost_model import CostModel  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402
from primuspipe.tools.pp_vis import load_iterations  # noqa: E402

GPT = tiny_models.TINY_MODELS["tiny-gpt"]
PP, STEPS = 2, 12
RUNS = {"1f1b": 4, "interleaved-1f1b": 6, "zbv": 6}
"""Algorithm -> microbatches; 1F1B (the calibration) runs with one split probe per chunk."""


def _worker(dump_root: str, ctx) -> dict:
    from megatron.core import parallel_state

    def layout(vpp: int) -> None:  # one process holds models of both vpp: say which one runs
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)

    runs = {}
    for name, m in RUNS.items():
        info = get_algorithm(name)
        vpp = info.resolve_vpp(None)
        spec = compare.StepSpec(GPT, m, ddp=True, placement=info.placement)
        config = PrimusPipeConfig(True, name, dump_pp_data=True, dump_dir=f"{dump_root}/{name}",
                                  split_probe=1 if name == "1f1b" else 0)
        layout(vpp)
        runs[name] = (vpp, spec, compare.build(spec, PP, vpp)[2], PrimusForwardBackward(config))
    for step in range(STEPS):
        for name in runs:
            vpp, spec, model, schedule = runs[name]
            layout(vpp)
            for chunk in model:
                chunk.zero_grad_buffer()
            torch.distributed.barrier()
            compare.call_schedule(schedule, spec, model)
    # the same ZBV step timed (hooks on) and not: the same gradients, bitwise
    vpp, spec, model, timed = runs["zbv"]
    layout(vpp)
    grads = []
    for schedule in (timed, PrimusForwardBackward(PrimusPipeConfig(True, "zbv"))):
        for chunk in model:
            chunk.zero_grad_buffer()
        compare.call_schedule(schedule, spec, model)
        grads.append({n: p.main_grad.clone() for chunk in model for n, p in chunk.named_parameters()})
    return {"same_grads": all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])}


@functools.lru_cache(maxsize=None)
def _dumps(root: str) -> list:
    return run_on_gloo(functools.partial(_worker, root), ParallelLayout(PP, 2), timeout_s=600)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk_costs")
    results = _dumps(str(root))
    return root, results


def test_dumps_time_the_layers_and_the_embedding_without_changing_gradients(dumps):
    root, results = dumps
    assert all(r["same_grads"] for r in results), "timing the layers changed a gradient"
    for name in RUNS:
        for timeline in load_iterations(root / name):
            for rt in timeline.ranks:
                compute = [e for e in rt.events if e.node.kind.is_compute]
                assert compute and all(e.layers is not None for e in compute), f"{name}: a node without layer time"
                for e in compute:
                    assert 0 < e.layers[0] <= e.end - e.start and 0 <= e.layers[1] <= e.cpu_time, (name, e)
                # the embedding is the first model stage's alone (rank 0, chunk 0 in both placements): its
                # forward in F, its backward in B and BW (W defers none of its gradients)
                for e in compute:
                    first = rt.rank == 0 and e.node.chunk == 0 and e.node.kind.name != "W"
                    assert (e.ends is not None) == first, (name, e)


@pytest.mark.parametrize("target", ["interleaved-1f1b", "zbv"])
def test_fixed_parts_predict_vpp2_node_times_better_than_the_even_cut(dumps, target):
    root, _ = dumps
    calibration = measure_costs(load_iterations(root / "1f1b"))
    cost = calibration.cost_dict()
    assert set(cost["compute"]["fixed"]) >= {"f", "b", "w", "bw"} and "chunk" in cost["compute"]
    even = {**cost, "compute": {k: v for k, v in cost["compute"].items() if k not in ("fixed", "chunk")}}
    run = load_iterations(root / target)
    measured = measure_costs(run)
    vpp = run[0].vpp
    with_fixed = CostModel.from_dict(cost, pp=PP, vpp=vpp)
    cut_evenly = CostModel.from_dict(even, pp=PP, vpp=vpp)
    pairs = [(measured.forward, with_fixed.compute.forward, cut_evenly.compute.forward)]
    if measured.fused_backward is not None:  # interleaved runs BW; ZBV runs B and W
        pairs.append((measured.fused_backward, with_fixed.fused_backward, cut_evenly.fused_backward))
    else:
        pairs += [(measured.backward_input, with_fixed.compute.backward_input, cut_evenly.compute.backward_input),
                  (measured.backward_weight, with_fixed.compute.backward_weight, cut_evenly.compute.backward_weight)]
    # the error in seconds over the seconds measured: a W of a tiny GPT takes 0.3-0.5 ms and swings by 40 %
    # from run to run (more under the NCCL emulator's group streams), which a mean of per-node ratios lets
    # outweigh the millisecond F and B nodes where the fixed cost shows
    measured_total = sum(sum(got) for got, *_ in pairs)
    error = {label: sum(abs(models[i][s] - got[s]) for got, *models in pairs for s in range(len(got))) / measured_total
             for i, label in enumerate(("fixed", "even"))}
    assert error["fixed"] < error["even"], error
