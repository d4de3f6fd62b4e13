"""Which mode chunkstate's kernels run in: compiled on a CUDA GPU, or Triton's interpreter on CPU.

``chunkstate/__init__.py`` sets ``TRITON_INTERPRET=1`` when no CUDA GPU is present; this module
only reads the outcome. Under the interpreter (``INTERPRET`` is True):

- tensors handed to kernels must live on the CPU (``DEVICE`` is ``"cpu"``);
- bf16 arithmetic and ``tl.dot`` on bf16 are silently wrong: test fp32 / fp16 there;
- ``@triton.autotune`` accepts a single config only, so chunkstate collapses its lists to one;
- each program costs milliseconds per chunk: keep shapes small (T <= 256, K, V <= 64).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE: str = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


@dataclass(frozen=True)
class Environment:
    interpreter: bool  # True: Triton's interpreter runs the kernels on CPU tensors
    device: str  # where kernel inputs must live: "cuda" or "cpu"
    device_name: str  # the GPU's name, or the CPU
    torch_version: str
    triton_version: str

    def __str__(self) -> str:
        mode = "Triton interpreter (CPU)" if self.interpreter else "compiled Triton on the GPU"
        return (f"chunkstate runs kernels with {mode}; device={self.device} ({self.device_name}); "
                f"torch {self.torch_version}, triton {self.triton_version}")


def environment() -> Environment:
    """Describe the mode and device chunkstate's kernels use (see the module docstring)."""
    import triton

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    return Environment(INTERPRET, DEVICE, name, torch.__version__, triton.__version__)


def interpreter_ready() -> bool:
    """Whether the kernels can run in this mode: always when compiled; under the interpreter
    (``INTERPRET``) only if Triton was imported after ``TRITON_INTERPRET=1`` was set. Triton's own
    ``@triton.jit`` helpers (``tl.cdiv``, ``tl.sum``, ...) are decorated when Triton is imported;
    imported before, they are GPU functions, and an interpreted kernel that calls one fails deep
    inside Triton ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    if not INTERPRET:
        return True
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


NOT_READY = ("Triton was imported before TRITON_INTERPRET=1 was set, so its helpers were made for a GPU and the "
             "interpreter cannot run chunkstate's kernels in this process. Import chunkstate before triton "
             "(chunkstate sets TRITON_INTERPRET=1 when there is no CUDA GPU), or set TRITON_INTERPRET=1 in the "
             "environment before Python starts")


def check_interpreter() -> None:
    """Raise RuntimeError (``NOT_READY``) where the kernels cannot run (``interpreter_ready``)."""
    if not interpreter_ready():
        raise RuntimeError(NOT_READY)


def backport_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound (a 1-element array there) into an int with
    ``int(array)``, which NumPy 2.4 and later refuse ("only 0-dimensional arrays can be converted to
    Python scalars"): every kernel loop over a runtime chunk count failed under it. Triton 3.7 and
    later squeeze the array first; this applies that same line to the interpreter of an older Triton
    (called at import, under the interpreter only)."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patch_with_squeezed_index(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_with_squeezed_index.squeezes_index = True
    interpreter._patch_lang_tensor = patch_with_squeezed_index
