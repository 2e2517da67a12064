"""``project``'s newer fields against every accelerator file: a training's ``attention_kernel`` (each name a hardware
file defines, a misspelling, another case) and the flex dispatcher's token destinations (``comm.token_destinations``,
the nodes DeepEP sends a token to) over expert grids whose expert-tensor-parallel groups reach past a node, under
round-robin and routed balance. The rule: a projection with finite figures, or one clear line naming the field.

Defects this family found: an attention kernel the hardware file does not define was refused once per algorithm in
the report, with no error line; the flex dispatcher over an expert split across nodes (ETP above the node's GPUs)
divided by zero experts per node (a ZeroDivisionError traceback under round-robin routing)."""

from pathlib import Path

import pytest
import yaml

from hostile_support import projected_or_named, refused, run_cli

EXAMPLES = Path(__file__).parents[2] / "examples" / "projection"
HARDWARE = sorted(p.stem for p in (EXAMPLES / "hardware").glob("*.yaml"))


def _project(tmp_path, hardware: str, model: dict, training: dict):
    files = {}
    for kind, base, changes in (("model", "mixtral-8x7b", model), ("training", "mixtral-8x7b", training)):
        folder = {"model": "models", "training": "training"}[kind]
        data = yaml.safe_load((EXAMPLES / folder / f"{base}.yaml").read_text())
        data.update(changes)
        files[kind] = tmp_path / f"{kind}.yaml"
        files[kind].write_text(yaml.safe_dump(data))
    return run_cli(["project", "--model", files["model"], "--training", files["training"], "--hardware",
                    EXAMPLES / "hardware" / f"{hardware}.yaml", "-a", "1f1b", "--json"])


def _kernels() -> list[tuple[str, str]]:
    cases = []
    for hardware in HARDWARE:
        known = sorted((yaml.safe_load((EXAMPLES / "hardware" / f"{hardware}.yaml").read_text())
                        .get("attention_kernels") or {}))
        cases += [(hardware, name) for name in known[:1] + [k.upper() for k in known[:1]]]
        cases += [(hardware, "flash3"), (hardware, "nosuch")]
    return cases


@pytest.mark.parametrize("hardware, kernel", _kernels())
def test_attention_kernels(tmp_path, hardware, kernel):
    outcome = _project(tmp_path, hardware, {}, {"attention_kernel": kernel})
    known = yaml.safe_load((EXAMPLES / "hardware" / f"{hardware}.yaml").read_text()).get("attention_kernels") or {}
    if kernel in known:
        projected_or_named(outcome, f"project attention_kernel {kernel} on {hardware}", "attention_kernel")
    else:
        refused(outcome, "attention_kernel", "attention_kernels",
                case=f"project attention_kernel {kernel} on {hardware}")


GRIDS = [(experts, ep, etp) for experts in (2, 8) for ep in (1, 2) for etp in (1, 4, 8, 16, 32) if ep <= experts]


@pytest.mark.parametrize("experts, ep, etp", GRIDS)
@pytest.mark.parametrize("balance", ["even", "uniform", None])
def test_flex_dispatcher_over_expert_grids(tmp_path, experts, ep, etp, balance):
    """TP = ETP = 1..32 (heads and groups 32), EP 1-2: the expert group spans 1 to 8 nodes of 8 GPUs."""
    training = {"tensor_model_parallel_size": etp, "expert_tensor_parallel_size": etp, "sequence_parallel": etp > 1,
                "expert_model_parallel_size": ep, "data_parallel_size": ep, "pipeline_model_parallel_size": 4,
                "global_batch_size": 64, "moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep"}
    if balance:
        training.update(moe_router_force_load_balancing=True, moe_router_force_load_balancing_type=balance)
    outcome = _project(tmp_path, "h100", {"num_experts": experts, "num_query_groups": 32}, training)
    case = f"project flex E{experts} EP{ep} ETP{etp} balance {balance}"
    if etp > 8:
        refused(outcome, "expert_tensor_parallel_size", "gpus_per_node", case=case)
    else:
        projected_or_named(outcome, case, "expert")
