"""A Primus user switches without edits: Primus's ``primus_pipeline.yaml`` (written here from its
documented keys and defaults) loads as it is, and with each of Primus's algorithm names trains a tiny
GPT in real megatron-core (CPU, gloo, pp = 2, DDP + SGD step) to the same losses, gradients and
parameters, bitwise, as Megatron's native schedule of the same layout (1F1B, interleaved 1F1B), or as a
pp = 1 run for the V-shape names, whose chunk layout Megatron's schedules cannot run.

One gloo launch per layout runs all of its names.
"""

import contextlib
import dataclasses
import functools
import importlib.util
import io

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

from megatron_harness import assert_same_tensors, merged, pp1_references, stacked_losses  # noqa: E402

from primuspipe.backends.megatron.config import PrimusPipeConfig, load_config  # noqa: E402
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward  # noqa: E402
from primuspipe.ir.activations import peak_in_flight  # noqa: E402
from primuspipe.testing.megatron import compare, tiny_models  # noqa: E402
from primuspipe.testing.megatron.distributed_cpu import ParallelLayout, run_on_gloo  # noqa: E402

GPT = tiny_models.TINY_MODELS["tiny-gpt"]
M = 4

PRIMUS_PIPELINE_YAML = """\
patch_primus_pipeline: false

pp_algorithm: "1f1b-interleaved"

communication_method: "async_p2p"

debug_scheduler_table: false

offload: false

offload_ops: ""

pp_max_mem: null
pp_cost_f: null
pp_cost_b: null
pp_cost_w: null
"""
"""Primus's primus_pipeline.yaml with the defaults its documentation gives for every key."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    """Primus's pp_algorithm."""
    runs: str
    """The primuspipe algorithm the name runs."""
    layout: ParallelLayout
    reference: str
    """"native": Megatron's own schedule of the layout in the same launch; "pp1": a pp=1 run."""
    edits: tuple = ()
    """Other lines of the YAML set as a user would for this name (key, YAML value)."""

    @property
    def placement(self):
        return "v" if self.reference == "pp1" else "interleaved"

    def yaml(self) -> str:
        text = PRIMUS_PIPELINE_YAML.replace("patch_primus_pipeline: false", "patch_primus_pipeline: true")
        text = text.replace('pp_algorithm: "1f1b-interleaved"', f'pp_algorithm: "{self.name}"')
        for key, value in self.edits:
            text = "\n".join(f"{key}: {value}" if line.startswith(f"{key}:") else line for line in text.splitlines())
        return text

    def spec(self):
        return compare.StepSpec(GPT, M, ddp=True, optimizer_step=True, placement=self.placement)


PP2, PP2_VPP2 = ParallelLayout(2), ParallelLayout(2, vpp=2)
HEURISTIC_EDITS = (("pp_cost_f", "1000"), ("pp_cost_b", "[2000, 2000]"), ("pp_cost_w", "800"), ("pp_max_mem", "2"))
CASES = (Case("1f1b", "1f1b", PP2, "native"), Case("zero-bubble", "zb-h1", PP2, "native"),
         Case("zero-bubble-heuristic", "zb-auto", PP2, "native", HEURISTIC_EDITS),
         Case("1f1b-interleaved", "interleaved-1f1b", PP2_VPP2, "native"),
         Case("zbv-formatted", "zbv", PP2_VPP2, "pp1", (("debug_scheduler_table", "true"),)),
         Case("zbv-greedy", "v-half", PP2_VPP2, "pp1"), Case("v-half", "v-half", PP2_VPP2, "pp1"),
         Case("v-min", "v-min", PP2_VPP2, "pp1"))


def _worker(layout, files, ctx):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = {}
    for case in CASES:
        if case.layout != layout:
            continue
        schedule = PrimusForwardBackward(load_config(files[case.name], env={}))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            ours = compare.run_step(schedule, case.spec(), layout.pp, layout.vpp)
        out[case.name] = {"ours": ours, "printed": printed.getvalue(),
                          "table": schedule.table_for(layout.pp, layout.vpp, M)}
        if case.reference == "native":
            out[case.name]["native"] = compare.run_step(get_forward_backward_func(), case.spec(), layout.pp, layout.vpp)
    return out


@pytest.fixture(scope="module")
def yaml_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("primus")
    files = {}
    for case in CASES:
        files[case.name] = str(folder / f"{case.name}.yaml")
        (folder / f"{case.name}.yaml").write_text(case.yaml())
    return tuple(sorted(files.items()))


@functools.lru_cache(maxsize=None)
def _run(layout, files):
    return run_on_gloo(functools.partial(_worker, layout, dict(files)), layout, timeout_s=300)


def test_primus_pipeline_yaml_loads_as_shipped(tmp_path):
    path = tmp_path / "primus_pipeline.yaml"
    path.write_text(PRIMUS_PIPELINE_YAML)
    assert load_config(path, env={}) == PrimusPipeConfig(pp_algorithm="1f1b-interleaved")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_primus_name_trains_like_megatron(case, yaml_files):
    results = _run(case.layout, yaml_files)
    rows = [r[case.name] for r in results]
    if case.reference == "native":
        want_losses = stacked_losses(rows[-1]["native"])
        want_grads, want_params = (merged(results, case.name, "native", a) for a in ("grads", "params"))
    else:
        ref = pp1_references(frozenset({(GPT, M, True)}))[(GPT, M, True)]
        want_losses, want_grads, want_params = stacked_losses(ref), ref.grads, ref.params
    got_losses = stacked_losses(rows[-1]["ours"])
    assert len(got_losses) == M and torch.equal(got_losses, want_losses)
    assert_same_tensors(merged(results, case.name, "ours", "grads"), want_grads, "grad", bitwise=True)
    assert_same_tensors(merged(results, case.name, "ours", "params"), want_params, "param after SGD", bitwise=True)
    table = rows[0]["table"]
    assert (table.algorithm, table.vpp) == (case.runs, case.layout.vpp)
    if case.name == "zero-bubble-heuristic":  # the memory limit reached the search
        assert max(peak_in_flight(table, retained=1.0)) <= 2
    if case.name == "zbv-formatted":  # debug_scheduler_table prints the table once, on rank 0
        assert rows[0]["printed"].count(table.grid()) == 1 and rows[1]["printed"] == ""
