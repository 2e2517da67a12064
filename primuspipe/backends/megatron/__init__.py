"""primuspipe's Megatron backend: run any primuspipe table inside megatron-core training.

>>> from primuspipe.backends.megatron import install, PrimusPipeConfig   # doctest: +SKIP
>>> install(PrimusPipeConfig(patch_primus_pipeline=True, pp_algorithm="gpipe"))   # doctest: +SKIP

See docs/megatron.md. Megatron itself is imported only when a step runs or ``install`` is called.
"""

from primuspipe.backends.megatron.config import PrimusPipeConfig, load_config
from primuspipe.backends.megatron.install import install, is_installed, uninstall
from primuspipe.backends.megatron.schedule_func import PrimusForwardBackward

__all__ = ["PrimusForwardBackward", "PrimusPipeConfig", "install", "is_installed", "load_config", "uninstall"]
