"""chunkstate: the gated chunked state recurrence of linear attention, from a loop to Triton.

Importing chunkstate picks how its Triton kernels run *before* any of them is decorated:
on a machine without a CUDA GPU it sets ``TRITON_INTERPRET=1`` (Triton's interpreter, CPU
tensors), so every notebook and test runs on a laptop. A value you set yourself is kept.
Import chunkstate before triton: Triton decorates its own helpers when it is imported, so an
interpreter mode set after that cannot run kernels (a call then raises, saying so).
``chunkstate.environment()`` tells which mode and device you are in.
"""
import os as _os
import sys as _sys

if "TRITON_INTERPRET" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in _sys.modules:  # too late for Triton's own helpers: kernel calls raise (env.check_interpreter)
            import warnings as _warnings

            _warnings.warn("chunkstate set TRITON_INTERPRET=1 (no CUDA GPU), but triton was imported first: "
                           "its kernels cannot run in this process. Import chunkstate before triton.",
                           stacklevel=2)

from .env import DEVICE, INTERPRET, environment  # noqa: E402
from . import delta, gates, reference, testing  # noqa: E402
from .forward import chunk_fwd_h  # noqa: E402
from .backward import chunk_bwd_dh  # noqa: E402
from .gla import chunk_gla  # noqa: E402

__all__ = ["DEVICE", "INTERPRET", "environment", "delta", "gates", "reference", "testing", "chunk_fwd_h", "chunk_bwd_dh", "chunk_gla"]
__version__ = "0.1.0"
