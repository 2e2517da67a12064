"""The Megatron drop-in called without the process groups it runs on: before Megatron's parallel state is
initialized (``initialize_model_parallel`` not yet called, or torch.distributed not even started), or with a
``pg_collection`` / ``p2p_communicator`` pair that is not megatron-core's (a dict, an empty
``ProcessGroupCollection``, a communicator with no ``pp_group``).

Megatron's own schedules meet these as a bare assert inside ``parallel_state`` ("pipeline_model parallel group
is not initialized"), a bare assert on ``pg_collection``'s attributes or a TypeError; the drop-in met them as the
same assert, or an AttributeError from the first use of the group. Each is now one PrimusPipeError line naming
what is missing and what to call or pass.

The cases run in one interpreter of their own that never starts a process group: the pytest process may hold
Megatron's parallel state from another test, and these calls must see it uninitialized.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hostile_support import Outcome, refused

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

CHILD = r'''
import json, sys
import torch
from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
enable_cpu_mode()
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from primuspipe.backends.megatron import PrimusPipeConfig
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward
from primuspipe.errors import PrimusPipeError

class Chunk(torch.nn.Linear):
    def __init__(self):
        super().__init__(8, 8)
        self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)

def groups(**set_):
    collection = ProcessGroupCollection()
    for name, value in set_.items():
        setattr(collection, name, value)
    return collection

class Communicator:
    def __init__(self, pp_group):
        self.pp_group = pp_group

CASES = {
    "no parallel state": {},
    "pg_collection a dict": dict(p2p_communicator=Communicator(object()), pg_collection={}),
    "pg_collection of no groups": dict(p2p_communicator=Communicator(object()), pg_collection=groups()),
    "pg_collection of tp only": dict(p2p_communicator=Communicator(object()), pg_collection=groups(tp=object())),
    "pg_collection text": dict(p2p_communicator=Communicator(object()), pg_collection="tp"),
    "p2p_communicator of no pp_group": dict(p2p_communicator=object(), pg_collection=groups(tp=object(), cp=object())),
    "p2p_communicator's pp_group None": dict(p2p_communicator=Communicator(None),
                                             pg_collection=groups(tp=object(), cp=object())),
}
results = {}
for case, extra in CASES.items():
    fb = PrimusForwardBackward(PrimusPipeConfig(True, "1f1b"))
    try:
        fb(forward_step_func=lambda it, model: None, data_iterator=iter([]), model=Chunk(), num_microbatches=4,
           seq_length=8, micro_batch_size=2, **extra)
        results[case] = ["silent", ""]
    except PrimusPipeError as exc:
        results[case] = ["clear", str(exc).splitlines()[0]]
    except Exception as exc:
        results[case] = ["traceback", f"{type(exc).__name__}: {exc}"]
print("RESULTS " + json.dumps(results))
'''

NAMED = {
    "no parallel state": ("parallel state", "initialize_model_parallel"),
    "pg_collection a dict": ("pg_collection",),
    "pg_collection of no groups": ("pg_collection", "tp and cp"),
    "pg_collection of tp only": ("pg_collection", "tp and cp"),
    "pg_collection text": ("pg_collection",),
    "p2p_communicator of no pp_group": ("p2p_communicator", "pp_group"),
    "p2p_communicator's pp_group None": ("p2p_communicator", "pp_group"),
}


@pytest.fixture(scope="module")
def outcomes():
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("case", list(NAMED))
def test_a_call_without_megatrons_process_groups(outcomes, case):
    kind, message = outcomes[case]
    refused(Outcome(kind, None, message), *NAMED[case], case=f"Megatron forward-backward: {case}")
