"""The Megatron drop-in (``PrimusForwardBackward``, what ``get_forward_backward_func`` returns once installed)
called as Megatron's training loop calls it, with what a user's code can get wrong: the call's own arguments
(``num_microbatches``, ``seq_length``, ``micro_batch_size``, ``model``, ``data_iterator``), and what
``forward_step_func`` and its loss function return while the step runs.

Defects this family found, each now one PrimusPipeError line naming the argument, microbatch and stage:
``forward_step_func`` returning a tensor alone (``'Tensor' object is not callable`` inside Megatron), a loss
function returning one value, four, a bare tensor or a Python float (a bare assert or an AttributeError), a
token count that is an int or a float tensor (``clamp()``'s TypeError, "Float can't be cast to Int"), a loss that
is not one value in a training step (``loss_func=None``, a per-token loss, ``collect_non_loss_data`` while
training: torch's "grad can be implicitly created only for scalar outputs"), a data iterator that runs out
before ``num_microbatches`` (a bare StopIteration, which a generator around the training loop swallows),
``seq_length``/``micro_batch_size`` of None or text (a TypeError) or not those of the batches (the next stage's
receive buffer is of another size, left partly filled: on two gloo ranks a shape error deep in the next stage's
model), a model given as a tuple or an empty list, and an ``adjust_tensor_shapes_fn`` returning other than two
lists of one shape (an unpacking error).

The step runs in-process on a one-rank gloo group (pp = 1; vpp = 2 hands the activation from chunk 0 to
chunk 1 as a transfer would), in an interpreter of its own: Megatron's parallel state makes gloo subgroups whose
threads outlive ``destroy_process_group``, and a process that ran them forks gloo ranks that hang or crash (the
fork-launched Megatron tests after this file did). test_megatron_step_isolated.py runs this file so. A loss
dict the V cannot send: test_megatron_loss_handoff.py.
"""

import importlib.util
import os

import pytest

IN_OWN_INTERPRETER = "PRIMUSPIPE_HOSTILE_OWN_INTERPRETER"
"""Set by test_megatron_step_isolated.py in the interpreter it runs this file in."""

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
    pytest.mark.skipif(os.environ.get(IN_OWN_INTERPRETER) != "1",
                       reason="run in an interpreter of its own by test_megatron_step_isolated.py"),
]

import torch  # noqa: E402

from hostile_support import accepted, record, refused, run_api, run_in_step  # noqa: E402

M = 4
"""Microbatches per step."""


@pytest.fixture(scope="module", autouse=True)
def megatron_on_one_rank():
    import torch.distributed as dist

    from primuspipe.backends.megatron.cpu_mode import cpu_rng_seed, enable_cpu_mode

    enable_cpu_mode()
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cpu_rng_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _tiny():
    from primuspipe.testing.megatron import tiny_models

    return tiny_models.TinyModelConfig(num_layers=2)


def _step(vpp: int = 1, algorithm: str | None = None, forward_step_func=None, batches: int = M, **call):
    """One forward-backward call of a freshly built tiny GPT at pp = 1 with ``vpp`` chunks; ``call`` replaces the
    call's keyword arguments. Returns ``(forward_backward, kwargs)``, to be called."""
    from primuspipe.backends.megatron import PrimusPipeConfig
    from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
    from primuspipe.testing.megatron import compare, tiny_models

    spec = compare.StepSpec(_tiny(), batches)
    _, _, model = compare.build(spec, 1, vpp)
    iterators = [compare.batches(spec) for _ in model]
    fb = PrimusForwardBackward(PrimusPipeConfig(True, algorithm or ("interleaved-1f1b" if vpp > 1 else "1f1b")))
    kwargs = dict(forward_step_func=forward_step_func or tiny_models.forward_step,
                  data_iterator=iterators if vpp > 1 else iterators[0], model=model if vpp > 1 else model[0],
                  num_microbatches=M, seq_length=spec.model.seq_length, micro_batch_size=spec.model.micro_batch_size)
    return fb, {**kwargs, **call}


def _call(fb, kwargs):
    return fb(**kwargs)


def _output(batch_iterator, model):
    batch = next(batch_iterator)
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])


def _returning(result):
    """A forward_step_func returning ``result(output)``."""
    def forward_step(data_iterator, model):
        return result(_output(data_iterator, model))

    return forward_step


def _with_loss(loss_func):
    """A forward_step_func whose loss function is ``loss_func`` (Megatron calls it with the output)."""
    return _returning(lambda output: (output, loss_func))


def _scalar(output):
    return output.float().sum()


CALL_ARGUMENTS = [
    *[("num_microbatches", value, "microbatches") for value in (0, -1, True, 2.0, "4", None)],
    *[(name, value, name) for name in ("seq_length", "micro_batch_size") for value in (0, -1, None, 3.5, "8", True)],
    *[("decoder_seq_length", value, "decoder_seq_length") for value in (0, 2.5, "8")],
    *[("model", value, "model") for value in ("TUPLE", "EMPTY", "gpt", None)],
]


@pytest.mark.parametrize("argument, value, named", CALL_ARGUMENTS,
                         ids=[f"{a}={v!r}" for a, v, _ in CALL_ARGUMENTS])
def test_call_arguments(argument, value, named):
    fb, kwargs = _step()
    if value == "TUPLE":
        value = (kwargs["model"],)
    elif value == "EMPTY":
        value, kwargs["data_iterator"] = [], []
    kwargs[argument] = value
    refused(run_api(_call, fb, kwargs), named, case=f"Megatron forward-backward {argument}={value!r}")


RETURNS = [
    ("forward_step_func returns the output alone", _returning(lambda output: output), "forward_step_func"),
    ("forward_step_func returns three things", _returning(lambda output: (output, _scalar, None)), "forward_step_func"),
    ("forward_step_func returns no loss function", _returning(lambda output: (output, "loss")), "forward_step_func"),
    ("forward_step_func returns None", _returning(lambda output: None), "forward_step_func"),
    ("loss function returns one value", _with_loss(lambda output: (_scalar(output),)), "loss function"),
    ("loss function returns a tensor", _with_loss(_scalar), "loss function"),
    ("loss function returns four values", _with_loss(lambda output: (_scalar(output), 1, {}, 2)), "loss function"),
    ("loss function returns a float", _with_loss(lambda output: (1.0, {})), "loss function"),
    ("loss function returns None", _with_loss(lambda output: None), "loss function"),
    ("token count an int", _with_loss(lambda output: (_scalar(output), 5, {})), "num_tokens"),
    ("token count a float tensor", _with_loss(lambda output: (_scalar(output), torch.tensor(5.0), {})), "num_tokens"),
    ("token count of two", _with_loss(lambda output: (_scalar(output), torch.tensor([5, 5]), {})), "num_tokens"),
    ("no loss function while training", _with_loss(None), "loss"),
    ("a per-token loss", _with_loss(lambda output: (output.float(), {})), "loss"),
]


@pytest.mark.parametrize("vpp", [1, 2])
@pytest.mark.parametrize("case, forward_step_func, named", RETURNS, ids=[c for c, _, _ in RETURNS])
def test_what_the_step_functions_return(case, forward_step_func, named, vpp):
    fb, kwargs = _step(vpp, forward_step_func=forward_step_func)
    refused(run_in_step(_call, fb, kwargs), named, "microbatch 0", case=f"Megatron vpp={vpp}: {case}")


@pytest.mark.parametrize("vpp", [1, 2])
def test_collect_non_loss_data_while_training(vpp):
    fb, kwargs = _step(vpp, forward_step_func=_with_loss(lambda output, non_loss_data=False: {"seen": 1}),
                       collect_non_loss_data=True)
    refused(run_in_step(_call, fb, kwargs), "forward_only", case=f"Megatron vpp={vpp} collect_non_loss_data training")


@pytest.mark.parametrize("vpp", [1, 2])
@pytest.mark.parametrize("batches", [0, 1, M - 1])
def test_a_data_iterator_that_runs_out(vpp, batches):
    fb, kwargs = _step(vpp, batches=batches)
    refused(run_in_step(_call, fb, kwargs), "data iterator", f"microbatch {batches}", f"num_microbatches={M}",
            case=f"Megatron vpp={vpp} iterator of {batches} batches for {M} microbatches")


@pytest.mark.parametrize("edit", [{"seq_length": 2 * 8}, {"micro_batch_size": 1}, {"seq_length": 4},
                                  {"micro_batch_size": 3, "seq_length": 8}])
def test_a_transfer_shape_that_is_not_the_batches(edit):
    """The hand-off from chunk 0 to chunk 1 receives (seq_length, micro_batch_size, hidden)."""
    fb, kwargs = _step(2, **edit)
    refused(run_in_step(_call, fb, kwargs), "seq_length", "micro_batch_size", case=f"Megatron vpp=2 {edit}")


def _native_step(forward_step_func):
    """Megatron's own pp = 1 schedule on the same model and data: (losses, gradients)."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    return _losses_and_grads(*_step(forward_step_func=forward_step_func), forward_backward_no_pipelining)


def _losses_and_grads(fb, kwargs, schedule=None):
    losses = (schedule or fb)(**kwargs)
    grads = [p.grad.clone() if p.grad is not None else None for p in kwargs["model"].parameters()]
    return losses, grads


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


VALID = [
    ("Megatron's tiny GPT", None),
    ("a list in place of the tuple", _returning(lambda output: [output, lambda o: (_scalar(o), {"l": _scalar(o)})])),
    ("an int64 token count", _with_loss(lambda o: (_scalar(o), torch.tensor(3, dtype=torch.int64), {}))),
    ("a NaN loss", _with_loss(lambda o: (_scalar(o) * float("nan"), {"l": _scalar(o).detach()}))),
    ("a loss with no gradient (Megatron skips its backward)", _with_loss(lambda o: (_scalar(o).detach(), {}))),
]


@pytest.mark.parametrize("case, forward_step_func", VALID, ids=[c for c, _ in VALID])
def test_valid_steps_equal_megatrons_own(case, forward_step_func):
    """What Megatron's contract allows runs, with Megatron's own losses and gradients (NaN where they are NaN)."""
    from primuspipe.testing.megatron import tiny_models

    forward_step_func = forward_step_func or tiny_models.forward_step
    ours = _losses_and_grads(*_step(forward_step_func=forward_step_func))
    native = _native_step(forward_step_func)
    ok = _same(ours, native)
    record("sound" if ok else "silent", f"Megatron {case}")
    assert ok, case


@pytest.mark.parametrize("vpp", [1, 2])
def test_forward_only_and_non_loss_data(vpp):
    """Forward-only calls: the output itself with no loss function, non-loss data with collect_non_loss_data."""
    for what, forward_step_func, extra in (
            ("no loss function", _with_loss(None), {}),
            ("non-loss data", _with_loss(lambda output, non_loss_data=False: {"seen": 1}),
             {"collect_non_loss_data": True}),
            ("a longer data iterator", None, {})):
        fb, kwargs = _step(vpp, forward_step_func=forward_step_func, batches=M + 2, forward_only=True, **extra)
        accepted(run_api(_call, fb, kwargs), case=f"Megatron vpp={vpp} forward_only {what}")


ADJUSTED = [None, "x", ([(8, 2, 16)],), ([(8, 2, 16)], [(8, 2, 16)], 3), ([(8, 2, 16)] * 2, [(8, 2, 16)] * 2),
            ([(8, 2, 16)], [(8, 2, 32)]), ([(8, "2", 16)], [(8, "2", 16)]), ([(8, 0, 16)], [(8, 0, 16)]),
            ([None], [None])]


@pytest.mark.parametrize("adjusted", ADJUSTED, ids=[repr(a)[:40] for a in ADJUSTED])
def test_adjust_tensor_shapes_fn_results(adjusted):
    """Its result was unpacked as (receive, send) and its shapes made the receive buffers: an unpacking error
    or torch's TypeError."""
    fb, kwargs = _step(2, adjust_tensor_shapes_fn=lambda recv, send: adjusted)
    refused(run_api(_call, fb, kwargs), "adjust_tensor_shapes_fn",
            case=f"Megatron adjust_tensor_shapes_fn -> {adjusted!r}")


def test_adjust_tensor_shapes_fn_keeping_the_shape_runs():
    fb, kwargs = _step(2, adjust_tensor_shapes_fn=lambda recv, send: (recv, send))
    accepted(run_api(_call, fb, kwargs), case="Megatron adjust_tensor_shapes_fn keeping the shape")
