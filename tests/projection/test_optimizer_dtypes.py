"""The optimizer's dtypes: master weights (or none, pure bf16 training), kept gradients and Adam's moments, in
static memory and in the optimizer step's bytes; their validation; Megatron's flags that set them.

Pure bf16 is checked against what PyTorch really allocates: a bf16 model stepped by ``torch.optim.AdamW`` (what
torchtitan's ``training.dtype = "bfloat16"`` runs). Megatron's precision-aware optimizer needs Transformer
Engine's FusedAdam, which a CPU-only install lacks, so its dtypes are checked by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from primuspipe.projection.framework import ConfigError
from primuspipe.projection.megatron_args import from_arguments
from primuspipe.projection.parameters import ParamCount
from primuspipe.projection.spec_fields import InputError, spec_from_mapping
from primuspipe.projection.static_memory import optimizer_step_bytes, static_memory
from primuspipe.projection.training_spec import TrainingSpec

PARAMS = ParamCount(dense=1000, expert=800)
TORCH_FSDP = dict(data_parallel_size=4, expert_model_parallel_size=2, use_megatron_fsdp=True,
                  data_parallel_sharding_strategy="optim_grads_params", fsdp_implementation="torch")
SHARD = 1000 / 4 + 800 / 2  # the rank's shard: dense over DP 4, experts over expert-DP 2
PURE_BF16 = dict(master_weights=False, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
"""torchtitan's ``training.dtype = "bfloat16"``: no master copy, ``torch.optim.AdamW``'s moments in bf16."""


def test_pure_bf16_keeps_no_master_copy_and_two_byte_gradients_and_moments():
    mixed = TrainingSpec(pipeline_model_parallel_size=1, use_distributed_optimizer=False)
    pure = dataclasses.replace(mixed, **PURE_BF16)
    a, b = static_memory(PARAMS, mixed), static_memory(PARAMS, pure)
    assert (a.weights, a.gradients, a.optimizer) == (2 * 1800, 4 * 1800, 12 * 1800)
    assert (b.weights, b.gradients, b.optimizer) == (2 * 1800, 2 * 1800, 4 * 1800)
    # Transformer Engine's FusedAdam at its defaults over bf16 weights: no master copy, fp32 moments
    fused_adam = static_memory(PARAMS, dataclasses.replace(mixed, master_weights=False))
    assert (fused_adam.gradients, fused_adam.optimizer) == (2 * 1800, 8 * 1800)
    # the distributed optimizer shards the two moments as it shards the master copy and moments
    sharded = static_memory(PARAMS, dataclasses.replace(pure, data_parallel_size=4, expert_model_parallel_size=2,
                                                        global_batch_size=8, use_distributed_optimizer=True))
    assert sharded.optimizer == pytest.approx(4 * SHARD)


def test_under_pytorch_fsdp_pure_bf16_the_bf16_shard_is_what_the_optimizer_steps():
    mixed = TrainingSpec(**TORCH_FSDP)
    pure = dataclasses.replace(mixed, **PURE_BF16)
    a, b = static_memory(PARAMS, mixed, layers=6), static_memory(PARAMS, pure, layers=6)
    assert a.weights == b.weights == pytest.approx(2 * 2 * 1800 / 6)  # the two gathered layers, bf16 either way
    assert (a.gradients, a.optimizer) == pytest.approx((4 * SHARD, (4 + 8) * SHARD))  # fp32 shard, grads, moments
    assert (b.gradients, b.optimizer) == pytest.approx((2 * SHARD, (2 + 4) * SHARD))  # all in bf16
    assert a.total - b.total == pytest.approx(8 * SHARD)  # 16 bytes a shard parameter against 8


def test_pytorch_fsdp_keeps_its_gradients_in_the_shards_dtype_whatever_it_reduces_in():
    """FSDP casts the reduce-scattered gradient back to the sharded parameter's dtype, so a bf16 reduction keeps
    fp32 gradients in mixed precision; Megatron keeps its bf16-reduced main gradients."""
    torch_fsdp = TrainingSpec(**TORCH_FSDP, grad_reduce_in_bf16=True)
    megatron = dataclasses.replace(torch_fsdp, fsdp_implementation="megatron")
    assert torch_fsdp.main_grad_bytes == megatron.main_grad_bytes == 2  # what both reduce in
    assert static_memory(PARAMS, torch_fsdp, layers=6).gradients == pytest.approx(4 * SHARD)
    assert static_memory(PARAMS, megatron, layers=6).gradients == pytest.approx(2 * SHARD)


def test_adams_step_moves_the_bytes_of_its_dtypes():
    mixed = TrainingSpec()
    assert optimizer_step_bytes(mixed) == 30  # fp32 grad, master, moments read; the last three and bf16 weight written
    assert optimizer_step_bytes(TrainingSpec(precision="fp32", use_distributed_optimizer=False)) == 4 + 2 * 8 + 2 * 4
    assert optimizer_step_bytes(TrainingSpec(**TORCH_FSDP)) == 4 + 2 * 12  # the fp32 shard is the weight
    assert optimizer_step_bytes(TrainingSpec(**TORCH_FSDP, **PURE_BF16)) == 2 + 2 * 6  # all bf16, in place
    assert optimizer_step_bytes(dataclasses.replace(mixed, **PURE_BF16)) == 2 + 2 * 4 + 2 * 2
    # megatron-core casts a bf16-reduced main gradient to fp32 for the step ...
    assert optimizer_step_bytes(TrainingSpec(grad_reduce_in_bf16=True)) == 30
    # ... unless the precision-aware optimizer reads it in place (bf16 or no FP8, or delayed scaling)
    narrow = TrainingSpec(use_precision_aware_optimizer=True, main_grads_dtype="bf16", exp_avg_dtype="bf16",
                          exp_avg_sq_dtype="bf16")
    assert optimizer_step_bytes(narrow) == 2 + 2 * (4 + 4) + 2
    assert optimizer_step_bytes(dataclasses.replace(narrow, fp8_format="hybrid", fp8_recipe="delayed")) == 20
    assert optimizer_step_bytes(dataclasses.replace(narrow, fp8_format="hybrid", fp8_recipe="tensorwise")) == 22


@pytest.mark.parametrize("values, fields", [
    ({"precision": "fp32", "use_distributed_optimizer": False}, ("master_weights", "precision")),
    ({"use_precision_aware_optimizer": True}, ("master_weights", "use_precision_aware_optimizer")),
    ({"fp8_format": "hybrid", "fp8_param_gather": True}, ("master_weights", "fp8_param_gather")),
    ({"main_params_dtype": "fp16"}, ("master_weights", "main_params_dtype")),
])
def test_pure_bf16_beside_a_setting_that_keeps_a_master_copy_is_refused_on_one_line(values, fields):
    with pytest.raises(InputError) as raised:
        spec_from_mapping(TrainingSpec, {"master_weights": False, **values}, "t.yaml")
    message = str(raised.value)
    assert "\n" not in message and all(f"t.yaml: {name}=" in message for name in fields)


def test_the_default_keeps_a_master_copy_and_a_bad_value_is_refused():
    assert TrainingSpec().master_weights is True
    with pytest.raises(InputError, match="master_weights"):
        spec_from_mapping(TrainingSpec, {"master_weights": "no"}, "t.yaml")
    # narrower moments are Megatron's precision-aware optimizer's, or a PyTorch optimizer's without a master copy
    with pytest.raises(InputError, match="need the precision-aware optimizer"):
        spec_from_mapping(TrainingSpec, {"exp_avg_dtype": "bf16"}, "t.yaml")
    assert spec_from_mapping(TrainingSpec, {"exp_avg_dtype": "bf16", "master_weights": False}, "t.yaml").master_weights is False


ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--vocab-size 100 --micro-batch-size 1 --global-batch-size 8 --bf16 --use-distributed-optimizer")


def test_megatrons_precision_aware_optimizer_flags_set_the_dtypes():
    _, training = from_arguments(ARGS + " --use-precision-aware-optimizer --main-grads-dtype bf16 --main-params-dtype "
                                 "fp16 --exp-avg-dtype bf16 --exp-avg-sq-dtype fp8", "args")
    assert (training.use_precision_aware_optimizer, training.main_params_dtype, training.main_grads_dtype,
            training.exp_avg_dtype, training.exp_avg_sq_dtype, training.master_weights) == (
        True, "fp16", "bf16", "bf16", "fp8", True)
    assert static_memory(ParamCount(dense=1000), training).optimizer == pytest.approx(1000 * (2 + 2 + 1))
    with pytest.raises(InputError, match="need the precision-aware optimizer"):
        from_arguments(ARGS + " --exp-avg-dtype bf16", "args")  # Megatron asserts the same


def test_a_bf16_model_stepped_by_adamw_allocates_what_pure_bf16_projects():
    """torchtitan's pure bf16: the model built in bf16, gradients in its dtype, ``torch.optim.AdamW``'s moments made
    ``zeros_like`` the parameters. Counted from the tensors PyTorch really holds after one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
    optimizer.step()
    params = list(model.parameters())
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    state = [t for p in params for t in optimizer.state[p].values() if t.dim() > 0]  # not the scalar step count
    projected = static_memory(ParamCount(dense=sum(p.numel() for p in params)),
                              TrainingSpec(pipeline_model_parallel_size=1, use_distributed_optimizer=False, **PURE_BF16))
    assert (projected.weights, projected.gradients, projected.optimizer) == (
        size(params), size(p.grad for p in params), size(state))


def _megatron_source(relative: str) -> ast.Module:
    """A module of the installed megatron-core, parsed (importing it needs triton and a GPU stack)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        pytest.skip(f"this megatron-core has no {relative}")
    return ast.parse(path.read_text())


def _megatron_fsdp_defaults() -> dict[str, str]:
    """What megatron-core does by default with Megatron-FSDP's main weights and gradients, read from its source: the
    ``DistributedDataParallelConfig`` fields, and Megatron-LM's ``--megatron-fsdp-main-grads-dtype`` default mapped
    through ``validate_args``'s ``dtype_map`` (as ``ast.unparse`` writes them: ``None``, ``torch.float32``, ...)."""
    config = next(c for c in ast.walk(_megatron_source("core/distributed/distributed_data_parallel_config.py"))
                  if isinstance(c, ast.ClassDef) and c.name == "DistributedDataParallelConfig")
    fields = {s.target.id: ast.unparse(s.value) for s in config.body if isinstance(s, ast.AnnAssign) and s.value}
    arguments = _megatron_source("training/arguments.py")
    dtype_map = next(ast.literal_eval(ast.unparse(ast.Dict(n.value.keys, [ast.Constant(ast.unparse(v))
                                                                          for v in n.value.values])))
                     for n in ast.walk(arguments) if isinstance(n, ast.Assign)
                     and getattr(n.targets[0], "id", None) == "dtype_map")
    flag = next(c for c in ast.walk(arguments) if isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "add_argument"
                and any(isinstance(a, ast.Constant) and a.value == "--megatron-fsdp-main-grads-dtype" for a in c.args))
    flag_default = next(k.value.value for k in flag.keywords if k.arg == "default")
    return {"grads": fields["megatron_fsdp_main_grads_dtype"], "params": fields["megatron_fsdp_main_params_dtype"],
            "grads_flag": dtype_map[flag_default]}


TORCH_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def test_megatron_fsdp_keeps_main_gradients_and_master_weights_as_megatron_cores_defaults_say():
    """Megatron-FSDP's main gradients default to the model's dtype (None: ``grad.dtype == param.dtype``) and its
    master weights to whatever megatron-core's config says; a bf16 run read from its arguments keeps and reduces
    exactly those bytes. Megatron's own distributed optimizer without Megatron-FSDP keeps fp32 main gradients."""
    defaults = _megatron_fsdp_defaults()
    assert defaults["grads_flag"] == defaults["grads"]  # Megatron-LM's flag default is the config's
    grad_bytes = 2 if defaults["grads"] == "None" else TORCH_BYTES[defaults["grads"]]  # None: the bf16 model's dtype
    fsdp = ARGS + " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
    _, training = from_arguments(fsdp, "args")
    assert training.main_grad_bytes == training.kept_grad_bytes == grad_bytes
    memory = static_memory(ParamCount(dense=1000), dataclasses.replace(training, data_parallel_size=4))
    assert memory.gradients == pytest.approx(grad_bytes * 1000 / 4)
    assert memory.optimizer == pytest.approx((TORCH_BYTES[defaults["params"]] + 8) * 1000 / 4)  # master + fp32 moments
    _, fp32_grads = from_arguments(fsdp + " --megatron-fsdp-main-grads-dtype fp32 --grad-reduce-in-bf16", "args")
    assert fp32_grads.main_grad_bytes == 4  # asked for; Megatron's --grad-reduce-in-bf16 is the DDP buffer's
    _, ddp = from_arguments(ARGS, "args")
    assert ddp.main_grad_bytes == 4  # Megatron's DDP accumulates and reduces in fp32 under bf16


def test_megatron_fsdp_main_gradient_dtypes_megatron_does_not_offer_are_refused():
    with pytest.raises(ConfigError, match="--megatron-fsdp-main-grads-dtype fp8: Megatron's choices"):
        from_arguments(ARGS + " --use-megatron-fsdp --megatron-fsdp-main-grads-dtype fp8", "args")
    with pytest.raises(ConfigError, match="under an fp32 model"):
        from_arguments(ARGS.replace(" --bf16", "") + " --use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16", "args")
