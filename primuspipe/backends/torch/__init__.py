"""The plain-PyTorch backend: any ``nn.Module`` split into stages, under any primuspipe table.

>>> from primuspipe.backends.torch import TorchPipeline, split_sequential   # doctest: +SKIP

See docs/torch.md and examples/train_torch.py.
"""

from primuspipe.backends.torch.pipeline import EvalOutput, TorchPipeline, split_sequential

__all__ = ["EvalOutput", "TorchPipeline", "split_sequential"]
