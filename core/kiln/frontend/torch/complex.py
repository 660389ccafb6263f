"""Complex values between the nodes of a torch graph.

Kiln has no complex dtype. A complex tensor computed inside a graph (`torch.fft.rfft`,
`torch.view_as_complex`, ...) is held by the interpreter as a `ComplexTensor`: a real Kiln
tensor `pairs` of shape `[*shape, 2]` holding each element's real and imaginary parts in its
last dim, the form `torch.view_as_real` gives. Mapping rules that take complex values
(kiln-mappings-builtin's element-wise ones, the FFTs) compute on those pairs with the real
operators; the others decline them. A graph's inputs and outputs stay real: a complex graph
input or output is reported by `unsupported_complex` (or, under fallback_to_eager, the nodes
making it run in PyTorch).
"""
from __future__ import annotations

import torch

from kiln.tensor import Tensor

COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128, torch.float16: torch.complex32}
REAL_OF = {c: r for r, c in COMPLEX_OF.items()}

SUPPORTED = ("complex values are supported inside a graph whose inputs and outputs are real: "
             "made by torch.fft.* / torch.stft / torch.view_as_complex, combined by + - * /, "
             "and made real by .real, .imag, .abs(), .angle() or torch.view_as_real")


class ComplexTensor:
    """A complex tensor of `shape` held as `pairs`, a real Kiln tensor of shape `[*shape, 2]`
    (real part, imaginary part): torch.view_as_real's form of it."""

    def __init__(self, pairs: Tensor):
        if pairs.ndim == 0 or pairs.shape[-1] != 2 or not pairs.dtype.is_float:
            raise ValueError(f"ComplexTensor: pairs must be a floating-point tensor whose last dim is 2, "
                             f"got {pairs.signature()}")
        self.pairs = pairs

    @property
    def shape(self) -> tuple:
        return self.pairs.shape[:-1]

    @property
    def ndim(self) -> int:
        return self.pairs.ndim - 1

    @property
    def device(self):
        return self.pairs.device

    @property
    def real_dtype(self) -> torch.dtype:
        """The torch dtype of each part (float32 for complex64)."""
        return self.pairs.dtype.torch_dtype

    @property
    def dtype(self) -> torch.dtype:
        """The torch complex dtype (complex64 for float32 pairs)."""
        return COMPLEX_OF[self.real_dtype]

    @property
    def is_symbolic(self) -> bool:
        return self.pairs.is_symbolic

    def signature(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)}[{self.device.kind}]"

    def __repr__(self) -> str:
        return f"ComplexTensor({self.signature()})"


def is_complex(value) -> bool:
    """Whether `value` is a complex tensor (a ComplexTensor, or a torch complex tensor)."""
    return isinstance(value, ComplexTensor) or (isinstance(value, torch.Tensor) and value.is_complex())


def unsupported_complex(where: str, what: str) -> str:
    """Why a complex graph input or output cannot be compiled: `where` names it, `what` gives
    its dtype and shape."""
    return (f"{where} is {what}: Kiln takes and returns real tensors only ({SUPPORTED}); "
            "return torch.view_as_real(...) of it, or run it in PyTorch with "
            "kiln.torch.dynamo_config.fallback_to_eager(True)")
