"""``primuspipe project``'s YAML inputs field by field: every number of the model, training and hardware
files at hostile magnitudes, parallel grids a dense model cannot tile, MoE settings past what routing
allows, the flex dispatcher's SMs against the GPU's, CUDA graphs over MoE layers, and rate tables that
contradict themselves. The rule for each input: a projection with finite figures, or one clear line
naming the field -- never a traceback, never a per-algorithm "not projected" list in its place."""

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from hostile_support import accepted, projected_or_named, refused, run_cli
from primuspipe.projection.hardware_spec import HardwareSpec
from primuspipe.projection.model_spec import ModelSpec
from primuspipe.projection.training_spec import TrainingSpec

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
MOE = {"model": EXAMPLES / "models" / "deepseek-v2-lite.yaml", "training": EXAMPLES / "training" / "mixtral-8x7b.yaml",
       "hardware": EXAMPLES / "hardware" / "mi355x.yaml"}
MIXTRAL = {**MOE, "model": EXAMPLES / "models" / "mixtral-8x7b.yaml"}
DENSE = {"model": EXAMPLES / "models" / "llama2-7b.yaml", "training": EXAMPLES / "training" / "default.yaml",
         "hardware": EXAMPLES / "hardware" / "h100.yaml"}
SPECS = {"model": ModelSpec, "training": TrainingSpec, "hardware": HardwareSpec}
MAGNITUDES = [10**20, 2**63, 1e300, 1e-300]
"""Beyond any size, count or rate, and below any rate: each was a traceback (int too large to convert to
float, index-sized integer, division by zero) or a row-by-row refusal naming a stage time, not the field."""


def _numeric_fields(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls)
            if f.name != "source" and {int, float} & set(typing.get_args(hints[f.name]) or (hints[f.name],))]


def _project(tmp_path, base: dict, kind: str, changes: dict, *extra) -> tuple:
    data = yaml.safe_load(base[kind].read_text())
    data.update(changes)
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(data))
    files = {**base, kind: path}
    return run_cli(["project", "--model", files["model"], "--training", files["training"], "--hardware",
                    files["hardware"], "-a", "1f1b", "--json", *extra])


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_number_at_hostile_magnitudes(tmp_path, kind):
    for name in _numeric_fields(SPECS[kind]):
        for value in MAGNITUDES:
            case = f"project {kind} {name}={value:g}"
            projected_or_named(_project(tmp_path, MOE, kind, {name: value}), case, name)


@pytest.mark.parametrize("etp, ep, dp", [(etp, ep, dp) for etp in (1, 2, 3, 4) for ep in (1, 2) for dp in (1, 2, 4)])
def test_dense_model_expert_grid(tmp_path, etp, ep, dp):
    """Megatron builds the expert grid (ETP x EP tiling TP x CP x DP) for dense models too: ETP 2 at DP 1
    divided the dense model's zero expert parameters by zero expert-data-parallel ranks (a traceback)."""
    outcome = _project(tmp_path, DENSE, "training", {"expert_tensor_parallel_size": etp,
                                                     "expert_model_parallel_size": ep, "data_parallel_size": dp,
                                                     "global_batch_size": 64})
    projected_or_named(outcome, f"project dense etp={etp} ep={ep} dp={dp}", "expert")


@pytest.mark.parametrize("imbalance", [1.0, 1.5, 4.0, 4.01, 8.0, 1e6])
def test_expert_load_imbalance_within_routing(tmp_path, imbalance):
    """Mixtral routes each token to 2 of 8 experts: the busiest expert gets at most every token, 4x the mean."""
    outcome = _project(tmp_path, MIXTRAL, "training", {"moe_expert_load_imbalance": imbalance})
    if imbalance <= 4:
        accepted(outcome, case=f"project moe_expert_load_imbalance={imbalance}")
    else:
        refused(outcome, "moe_expert_load_imbalance", "num_experts",
                case=f"project moe_expert_load_imbalance={imbalance}")


@pytest.mark.parametrize("sms", [1, 24, 131, 132, 133, 10**5])
@pytest.mark.parametrize("overlap", [False, True])
def test_dispatcher_sms_within_the_gpu(tmp_path, sms, overlap):
    """The flex dispatcher's SMs against H100's 132: more priced DeepEP on SMs that do not exist (silently
    faster) unless overlap was on; now refused up front either way, naming both files' fields."""
    base = {**MIXTRAL, "hardware": EXAMPLES / "hardware" / "h100.yaml"}
    changes = {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_num_sms": sms,
               "overlap_moe_expert_parallel_comm": overlap}
    outcome = _project(tmp_path, base, "training", changes)
    if sms < 132:
        projected_or_named(outcome, f"project flex sms={sms} overlap={overlap}", "moe_flex_dispatcher_num_sms")
    else:
        refused(outcome, "moe_flex_dispatcher_num_sms", "compute_units",
                case=f"project flex sms={sms} overlap={overlap}")


@pytest.mark.parametrize("impl", ["none", "local", "transformer_engine", "full_iteration"])
@pytest.mark.parametrize("modules", [[], ["attn"], ["moe"], ["moe_router", "moe_preprocess"]])
@pytest.mark.parametrize("padded", [False, True])
def test_cuda_graphs_over_moe_layers(tmp_path, impl, modules, padded):
    """Capturing an MoE layer not padded to capacity was refused once per algorithm (no error line);
    now one line before any is projected."""
    changes = {"cuda_graph_impl": impl, "cuda_graph_modules": modules}
    if padded:
        changes.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    outcome = _project(tmp_path, MIXTRAL, "training", changes)
    projected_or_named(outcome, f"project cuda graphs {impl} {modules} padded={padded}",
                       "moe_pad_expert_input_to_capacity")


@pytest.mark.parametrize("field", ["attention_length_rates", "attention_backward_length_rates",
                                   "attention_head_dim_rates", "attention_backward_head_dim_rates"])
@pytest.mark.parametrize("table", [[[2048, 0.9], [2048, 0.5]], [[128, 1.0], [4096, 1.0], [128, 1.0]],
                                   [[4096, 1e-300]], [[4096, 1e-9], [8192, 1.0]]])
def test_rate_tables_that_contradict_or_vanish(tmp_path, field, table):
    """A length given twice (the table took either rate, silently) or a rate that makes attention take
    1e300 times longer: refused naming the table."""
    refused(_project(tmp_path, MOE, "hardware", {field: table}), field, case=f"project {field}={table}")


@pytest.mark.parametrize("tile", [[2**31, 1], [2**40, 2**40], [8192, 128]])
def test_gemm_tiles_beyond_any_kernel(tmp_path, tile):
    refused(_project(tmp_path, DENSE, "hardware", {"gemm_tile": tile}), "gemm_tile", case=f"project gemm_tile={tile}")


@pytest.mark.parametrize("max_positions, embedding", [(1024, "learned_absolute"), (4095, "learned_absolute"),
                                                      (4096, "learned_absolute"), (1024, "rope")])
def test_learned_positions_shorter_than_the_sequence(tmp_path, max_positions, embedding):
    """Megatron asserts a learned position table covers the sequence; a rotary one has no table."""
    outcome = _project(tmp_path, DENSE, "model", {"max_position_embeddings": max_positions,
                                                  "position_embedding_type": embedding})
    if embedding == "learned_absolute" and max_positions < 4096:
        refused(outcome, "max_position_embeddings", case=f"project max_position_embeddings={max_positions}")
    else:
        accepted(outcome, case=f"project max_position_embeddings={max_positions} {embedding}")


@pytest.mark.parametrize("hardware", ["h100", "b200", "mi355x", "no fp8 peak"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_fp8_recipes_against_the_accelerator(tmp_path, hardware, recipe):
    """FP8 on an accelerator without an FP8 peak, or MXFP8 without block-scaled FP8 units, was refused once per
    algorithm ('not projected' lines, no error); now one line naming the recipe or the peak."""
    base = {**DENSE, "hardware": EXAMPLES / "hardware" / f"{'h100' if hardware == 'no fp8 peak' else hardware}.yaml"}
    if hardware == "no fp8 peak":
        data = {k: v for k, v in yaml.safe_load(base["hardware"].read_text()).items() if k != "peak_fp8_tflops"}
        base["hardware"] = tmp_path / "no_fp8.yaml"
        base["hardware"].write_text(yaml.safe_dump(data))
    outcome = _project(tmp_path, base, "training", {"fp8_format": "hybrid" if recipe == "delayed" else "e4m3",
                                                    "fp8_recipe": recipe})
    name = "peak_fp8_tflops" if hardware == "no fp8 peak" else "fp8_recipe"
    projected_or_named(outcome, f"project fp8 {recipe} on {hardware}", name)
