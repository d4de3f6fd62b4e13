"""chunkstate: the gated chunked state recurrence of linear attention, from a loop to Triton.

Importing chunkstate picks how its Triton kernels run *before* any of them is decorated:
on a machine without a CUDA GPU it sets ``TRITON_INTERPRET=1`` (Triton's interpreter, CPU
tensors), so every notebook and test runs on a laptop. A value you set yourself is kept.
Import chunkstate before triton: Triton decorates its own helpers when it is imported, so an
interpreter mode set after that cannot run kernels (a call then raises, saying so).
``chunkstate.environment()`` tells which mode and device you are in.
"""
import os as _os

if "TRITON_INTERPRET" not in _os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"

from .env import DEVICE, INTERPRET, environment  # noqa: E402
from .env import NOT_READY as _NOT_READY, interpreter_ready as _interpreter_ready  # noqa: E402

if not _interpreter_ready():  # triton imported too early: every kernel call raises (env.check_interpreter)
    import warnings as _warnings

    _warnings.warn(_NOT_READY, stacklevel=2)
if INTERPRET:  # Triton 3.6's interpreter and NumPy >= 2.4: loop bounds as Triton 3.7 turns them into ints
    from .env import backport_interpreter_index as _backport

    _backport()
from . import delta, gates, reference, testing  # noqa: E402
from .forward import chunk_fwd_h  # noqa: E402
from .backward import chunk_bwd_dh  # noqa: E402
from .gla import chunk_gla  # noqa: E402

__all__ = ["DEVICE", "INTERPRET", "environment", "delta", "gates", "reference", "testing", "chunk_fwd_h", "chunk_bwd_dh", "chunk_gla"]
__version__ = "0.1.0"
