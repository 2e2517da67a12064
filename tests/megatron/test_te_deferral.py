"""Our side of Transformer Engine's deferred-weight-gradient contract, on CPU, against the STAND-IN
(primuspipe/testing/te_standin.py, written from TE's source; TE itself needs CUDA): detection by
inheritance, one-line refusals, FIFO accounting per module (labels, counts, LayerNormMLP's two entries,
GroupedLinear's silent empty pop), the fused BW, the step-end check, the bias-gradient guard, and the
FIFO table rule over every shipped algorithm. Real-TE runs: test_te_gpu.py."""

import pytest
import torch

from primuspipe.algorithms import list_algorithms
from primuspipe.algorithms.build import build_schedule
from primuspipe.backends.megatron.te_deferral import TEDeferral, plan_te_deferral, te_weight_gemm
from primuspipe.errors import WeightGradError
from primuspipe.errors import ConfigError, ScheduleShapeError, ValidationError
from primuspipe.ir.node import NodeKind, ScheduleNode
from primuspipe.ir.placement import Placement
from primuspipe.ir.table import ScheduleTable
from primuspipe.passes.fifo_weight_grads import check_fifo_weight_grads
from primuspipe.testing import te_standin

import te_vendor_layers as vendor


class _Config:
    delay_wgrad_compute = True
    fp8 = None


def _consumer(module):
    """What Megatron DDP's hook does after backward_dw: add .grad to main_grad, clear .grad."""
    params = [p for p in module.parameters(recurse=False)]
    for p in params:
        p.main_grad = torch.zeros_like(p)

    def hook():
        for p in params:
            if p.grad is not None:
                p.main_grad.add_(p.grad)
                p.grad = None

    module.register_wgrad_accumulation_and_reduce_hooks(hook)
    return params


def _inputs(n, width=4):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, width, generator=gen) for _ in range(n)]


def test_stand_in_store_is_a_fifo_that_backward_dw_drains_and_assigns():
    layer = te_standin.Linear(4, 3, delay_wgrad_compute=True)
    assert all(p.skip_backward_post_hook for p in layer.parameters())
    x0, x1 = _inputs(2)
    layer(x0).sum().backward()
    layer(x1).sum().backward()
    assert layer.weight.grad is None and layer.wgrad_store.context.qsize() == 2
    layer.backward_dw()
    assert torch.equal(layer.weight.grad, torch.ones(3, 3).matmul(x0))  # dw = dy^T x, dy = 1
    layer.backward_dw()  # TE assigns: microbatch 1 overwrites microbatch 0 (hence the consumer hook requirement)
    assert torch.equal(layer.weight.grad, torch.ones(3, 3).matmul(x1))
    with pytest.raises(RuntimeError, match="empty"):
        layer.backward_dw()


def test_detection_is_by_inheritance_not_module_path():
    config = _Config()
    linear = vendor.MegatronStyleLinear(4, 4, config=config)
    assert type(linear).__module__ == "te_vendor_layers" and te_weight_gemm(linear) == "Linear"
    assert te_weight_gemm(te_standin.LayerNormMLP(4, 8)) == "LayerNormMLP"
    assert te_weight_gemm(te_standin.GroupedLinear(2, 4, 4)) == "GroupedLinear"
    assert te_weight_gemm(te_standin.DotProductAttention()) is None
    assert te_weight_gemm(torch.nn.Linear(2, 2)) is None
    _consumer(linear)
    plan = plan_te_deferral([torch.nn.Sequential(linear, te_standin.DotProductAttention(), torch.nn.LayerNorm(4),
                                                 vendor.TEGroupedMLP())], config, split=True)
    assert [m for _, m in plan[0]] == [linear], "attention, norms and look-alike names need nothing"


def _refusal(module, split=True, fp8=None):
    config = _Config()
    config.fp8 = fp8
    with pytest.raises(ConfigError) as info:
        plan_te_deferral([torch.nn.Sequential(torch.nn.Linear(2, 2), module)], config, split)
    message = str(info.value)
    assert "\n" not in message and "1 (" in message, message  # one line, naming the module ("1" in the Sequential)
    return message


def test_what_cannot_defer_is_refused_in_one_line_naming_the_module():
    config = _Config()
    turbo = vendor.PrimusTurboLinear(4, 4, config=config)
    _consumer(turbo)
    assert "Primus-Turbo" in _refusal(turbo)
    assert "Primus-Turbo" in _refusal(turbo, split=False), "its parameters are hooked through backward_dw only"
    assert "delay_wgrad_compute" in _refusal(te_standin.Linear(4, 4))
    plan_te_deferral([te_standin.Linear(4, 4)], config, split=False)  # a fused backward needs no deferral
    assert "no hook consumes" in _refusal(te_standin.Linear(4, 4, delay_wgrad_compute=True), split=False)
    assert "te.pytorch.ops" in _refusal(vendor.TEFusedMLP())
    assert "grouped_gemm" in _refusal(vendor.GroupedMLP())
    mlp = te_standin.LayerNormMLP(4, 8, delay_wgrad_compute=True)
    mlp.use_bias = True
    _consumer(mlp)
    assert "fp8" in _refusal(mlp, fp8="hybrid")
    fuser = _Config()
    fuser.use_transformer_engine_op_fuser = True
    linear = te_standin.Linear(4, 4, delay_wgrad_compute=True)
    _consumer(linear)
    with pytest.raises(ConfigError, match=r"use_transformer_engine_op_fuser=True runs TE layers such as 0 \(Linear"):
        plan_te_deferral([torch.nn.Sequential(linear)], fuser, split=True)


def _deferral(*modules):
    for m in modules:
        _consumer(m)
    return TEDeferral([[(f"layer{i}", m) for i, m in enumerate(modules)]])


def _reference_grads(make, inputs, run):
    """Gradients of each parameter summed over microbatches with the plain (non-deferred) backward."""
    torch.manual_seed(0)
    module = make(False)
    for x in inputs:
        run(module, x).sum().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


MODULES = {
    "linear": (lambda d: te_standin.Linear(4, 3, delay_wgrad_compute=d), lambda m, x: m(x)),
    "linear-return-bias": (lambda d: te_standin.Linear(4, 3, return_bias=True, delay_wgrad_compute=d),
                           lambda m, x: sum(m(x))),
    "layernorm-mlp": (lambda d: te_standin.LayerNormMLP(4, 6, delay_wgrad_compute=d), lambda m, x: m(x)),
    "grouped": (lambda d: te_standin.GroupedLinear(2, 4, 3, delay_wgrad_compute=d), lambda m, x: m(x, [1, 2])),
}


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("order", ["B0 B1 B2 W0 W1 W2", "B0 W0 B1 B2 W1 W2", "BW0 B1 W1 BW2"])
def test_w_nodes_drive_backward_dw_in_fifo_order(name, order):
    make, run = MODULES[name]
    inputs = _inputs(3)
    want = _reference_grads(make, inputs, run)
    torch.manual_seed(0)
    module = make(True)
    deferral = _deferral(module)
    for step in order.split():
        mb = int(step[-1])
        if step.startswith("B"):
            with deferral.collecting(0, mb):
                run(module, inputs[mb]).sum().backward()
        if step.startswith(("W", "BW")):
            assert deferral.flush(0, mb) == (2 if name == "layernorm-mlp" else 1)
    deferral.check_empty()
    got = {n: p.main_grad if p.grad is None else p.main_grad + p.grad for n, p in module.named_parameters()}
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=0, atol=1e-6, msg=n)


def test_out_of_order_w_and_leftovers_are_clear_errors():
    module = te_standin.Linear(4, 3, delay_wgrad_compute=True)
    deferral = _deferral(module)
    x0, x1 = _inputs(2)
    for mb, x in enumerate((x0, x1)):
        with deferral.collecting(0, mb):
            module(x).sum().backward()
    with pytest.raises(WeightGradError, match=r"W1\.0: the oldest deferred weight GEMM of layer0 .* microbatch 0's"):
        deferral.flush(0, 1)
    deferral.flush(0, 0)
    with pytest.raises(WeightGradError, match=r"\(layer0: 1\); every B needs its W"):
        deferral.check_empty()
    with pytest.raises(WeightGradError, match="starts the step with 1 deferred"):
        TEDeferral([[("layer0", module)]])


def test_a_module_that_ran_but_deferred_nothing_is_an_error():
    config = _Config()
    module = vendor.BypassingLinear(4, 3, config=config)
    deferral = _deferral(module)
    with deferral.forwarding(0, 0):
        out = module(_inputs(1)[0])
    with pytest.raises(WeightGradError, match="layer0 .*BypassingLinear.* put no weight GEMM.*W would be empty"):
        with deferral.collecting(0, 0):
            out.sum().backward()


def test_first_microbatch_overwrites_main_grad_so_its_w_must_come_first():
    """TE's is_first_microbatch with fuse_wgrad_accumulation: microbatch 0's GEMM copies into main_grad."""
    module = te_standin.Linear(4, 3, bias=False, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    module.weight.main_grad = torch.zeros_like(module.weight)
    deferral = TEDeferral([[("layer0", module)]])
    module.register_wgrad_accumulation_and_reduce_hooks(lambda: None)
    inputs = _inputs(2)
    for mb in (1, 0):  # a table whose chunk runs microbatch 1's backward first
        with deferral.collecting(0, mb):
            module(inputs[mb], is_first_microbatch=mb == 0).sum().backward()
    deferral.flush(0, 1)
    deferral.flush(0, 0)
    assert torch.equal(module.weight.main_grad, torch.ones(3, 3).matmul(inputs[0])), "microbatch 1 was erased"
    row = [ScheduleNode.parse(t) for t in "F0.0 F1.0 B1.0 B0.0 W1.0 W0.0".split()]
    table = ScheduleTable.build(Placement.interleaved(1, 1), 2, [row], "bad")
    with pytest.raises(ValidationError, match="fifo-weight-grads.*W1.0 is chunk 0's first weight-gradient node"):
        check_fifo_weight_grads(table)


def _shapes(info):
    """Every small shape; a search (zb-auto, placement "any") costs seconds per table, so a sample."""
    if info.placement == "any":
        return [(pp, m, vpp) for pp, m in ((2, 3), (2, 4), (3, 6), (4, 8)) for vpp in (1, 2)]
    return [(pp, m, vpp) for pp in range(1, 6) for m in range(1, 2 * pp + 4)
            for vpp in ([info.vpp] if info.vpp else [1, 2, 3])]


def _shipped_tables():
    for info in list_algorithms():
        for pp, m, vpp in _shapes(info):
            try:
                yield build_schedule(info.name, pp, m, vpp, communication=False)
            except ScheduleShapeError:
                continue


def test_every_shipped_algorithm_passes_the_fifo_rule_at_every_shape():
    tables = list(_shipped_tables())
    assert {t.algorithm for t in tables} == {a.name for a in list_algorithms()} and len(tables) > 400
    for table in tables:
        check_fifo_weight_grads(table)


@pytest.mark.parametrize("seed", range(30))
def test_tables_with_a_reordered_weight_gradient_are_refused(seed):
    """Generated breakages: two W nodes of one chunk on one rank swapped -- refused."""
    import random

    rng = random.Random(seed)
    table = build_schedule(rng.choice(["zb-h1", "zb-h2", "zbv", "v-half", "dualpipe-v"]), rng.randint(2, 4),
                           rng.randint(4, 9), communication=False)
    rows = [list(r) for r in table.ranks]
    rank = rng.randrange(table.pp)
    ws = [i for i, n in enumerate(rows[rank]) if n.kind is NodeKind.W]
    chunk = rows[rank][rng.choice(ws)].chunk
    same = [i for i in ws if rows[rank][i].chunk == chunk]
    i, j = sorted(rng.sample(same, 2))
    rows[rank][i], rows[rank][j] = rows[rank][j], rows[rank][i]
    broken = table.with_ranks(rows)
    with pytest.raises(ValidationError, match="fifo-weight-grads"):
        check_fifo_weight_grads(broken)


@pytest.mark.parametrize("order, ok", [("F0.0 F1.0 B0.0 B1.0 W0.0 W1.0", True), ("F0.0 F1.0 B0.0 B1.0 W1.0 W0.0", False),
                                       ("F0.0 F1.0 B0.0 BW1.0 W0.0", False)])
def test_validate_cli_fifo_weight_grads_flag(tmp_path, capsys, order, ok):
    from primuspipe.cli import main

    row = [ScheduleNode.parse(t) for t in order.split()]
    path = tmp_path / "table.json"
    path.write_text(ScheduleTable.build(Placement.interleaved(1, 1), 2, [row], "hand-made").to_json())
    assert main(["validate", str(path)]) == 0, "valid for the validator's other rules"
    assert main(["validate", "--fifo-weight-grads", str(path)]) == (0 if ok else 1)
    assert ("INVALID" in capsys.readouterr().out) is not ok
