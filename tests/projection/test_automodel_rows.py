"""The NeMo AutoModel rows carry what AutoModel's own code fixes, whatever its benchmark configurations say."""

from __future__ import annotations

from published_rows import shipped_runs
from primuspipe.projection.compute import WorkModel
from primuspipe.projection.published import model_of, training_of


def test_automodel_deepep_rows_permute_with_the_fused_kernels():
    """AutoModel's DeepEP experts build their token dispatcher with ``moe_permute_fusion=True`` hard-coded
    (``GroupedExpertsDeepEP.init_token_dispatcher`` in nemo_automodel/components/moe/layers.py at 8d9bfb90e and
    89e3a9fdd), so its permutation runs Transformer Engine's fused kernels and leaves no accumulating scatters."""
    rows = [r for r in shipped_runs() if "NVIDIA-NeMo/Automodel" in r.url and r.training.get("moe_token_dispatcher_type") == "flex"]
    assert len(rows) == 4, [r.id for r in rows]
    for run in rows:
        assert run.training.get("moe_permute_fusion") is True, run.id
        work = WorkModel(model_of(run), training_of(run)).accumulating_scatters("moe")
        assert work.forward.scatter_add_elements == work.backward_input.scatter_add_elements == 0, run.id


def test_automodel_moe_rows_step_a_bf16_model_with_pytorchs_adam():
    """The MoE benchmark configurations' optimizer is ``torch.optim.Adam`` over the bf16 model (examples/benchmark/
    configs/*_te_deepep.yaml at 8d9bfb90e and 89e3a9fdd): no master copy, moments ``zeros_like`` the bf16 parameters,
    2-byte kept gradients; the MoE parallelizer's FSDP2 policy reduces in fp32, so 4-byte reduction."""
    rows = [r for r in shipped_runs() if "NVIDIA-NeMo/Automodel" in r.url and r.training.get("expert_model_parallel_size")]
    assert len(rows) == 4, [r.id for r in rows]
    for run in rows:
        t = training_of(run)
        assert (t.master_weights, t.use_precision_aware_optimizer, t.exp_avg_dtype, t.exp_avg_sq_dtype) == (
            False, False, "bf16", "bf16"), run.id
        assert (t.kept_grad_bytes, t.main_grad_bytes) == (2, 4), run.id
