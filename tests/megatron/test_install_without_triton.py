"""``install()`` on a host whose torch has no triton (a CPU build), before CPU mode: megatron-core 0.19 imports
triton unguarded, and a first user trying the README's snippet on a laptop met its ModuleNotFoundError deep
in Megatron. It is one ConfigError naming CPU mode, which stubs triton; after ``enable_cpu_mode()`` the
same call installs."""

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton is installed here")

SNIPPET = """
import sys
from primuspipe.backends.megatron import install, PrimusPipeConfig
from primuspipe.errors import ConfigError
if sys.argv[1] == "cpu":
    from primuspipe.backends.megatron.cpu_mode import enable_cpu_mode
    enable_cpu_mode()
try:
    install(PrimusPipeConfig(patch_primus_pipeline=True, pp_algorithm="zb-h1"))
except ConfigError as exc:
    print("refused:", exc)
else:
    print("installed")
"""


@pytest.mark.parametrize("mode, said", [("plain", "refused: megatron-core imports triton"), ("cpu", "installed")])
def test_install_without_triton(mode, said):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", SNIPPET, mode], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(said), proc.stdout
    if mode == "plain":
        assert "enable_cpu_mode()" in proc.stdout
