"""What a test cannot run under the NCCL emulator (``PRIMUSPIPE_NCCL_EMULATION``), each with why.

The emulator models NCCL's progress rules; these are runs that real NCCL would hang on as well (torch's
runtime), or that need a process-group feature the emulator does not provide."""

import pytest

from primuspipe.runtime import nccl_emulation

TORCH_RUNTIME_HANGS = pytest.mark.skipif(
    nccl_emulation.mode() is not None,
    reason="torch's _PipelineScheduleRuntime posts each action as its own batch on the group's one NCCL stream, "
           "and primuspipe's CSV (receives posted a step early) hangs there -- on real NCCL as under the emulator "
           "(docs/torch.md); TorchPipeline runs these tables on NCCL")

NO_DEVICE_MESH = pytest.mark.skipif(
    nccl_emulation.mode() is not None,
    reason="torch's DeviceMesh takes the name of each group it creates, which the emulated group does not carry "
           "('ProcessGroup name not set'); DDP and FSDP2 stages run on plain gloo here")

GROUP_NOT_FREED = pytest.mark.skipif(
    nccl_emulation.mode() is not None,
    reason="an emulated group (a Python subclass of torch's pybind ProcessGroup) is kept alive by its C++ half "
           "whatever the watchdog does; the emulator ends its streams at exit instead")
