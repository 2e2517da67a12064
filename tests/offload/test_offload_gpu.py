"""The GPU path of activation offload: pinned host copies on side streams, the backward waiting for its
reload, gradients bitwise equal to a run without offload, and the device memory autograd holds falling."""

import pytest
import torch

from primuspipe.runtime.activation_offload import ActivationOffload
from primuspipe.testing.torch_pipelining import plain_model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_gpu_is_bitwise_neutral_and_frees_device_memory():
    device = torch.device("cuda")
    x = torch.randn(64, 256, device=device)

    def grads(offloaded: bool):
        model = plain_model(256, layers=4).to(device)
        offload = ActivationOffload([model], device)
        with offload.forward(0, 0):
            loss = model(x).square().mean()
        held = offload.saved.now
        if offloaded:
            offload.offload(0, 0)
            torch.cuda.synchronize()
            assert offload.saved.now == 0 < held
            offload.reload(0, 0)
        loss.backward()
        return [p.grad for p in model.parameters()], held

    (plain, held), (lean, _) = grads(False), grads(True)
    assert held > 0 and all(torch.equal(a, b) for a, b in zip(plain, lean))
