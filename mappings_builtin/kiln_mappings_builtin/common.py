"""Helpers shared by the rules: one rule for targets whose signature is a Kiln operator's."""
from __future__ import annotations

from kiln import ops
from kiln.frontend.torch import register_function, register_method
from kiln.tensor import Tensor


def no_out(*args, out=None, **kwargs) -> bool:
    """A check declining calls that write into an `out=` tensor."""
    return out is None


def direct(op: str, functions=(), methods=()):
    """Map torch functions and Tensor methods with the signature of `kiln.ops.<op>` to it.

    An `inplace` flag, by keyword or as the extra last positional argument of torch.nn.functional
    activations, is dropped: the interpreter rebinds the mutated tensor.
    """
    def rule(*args, inplace=False, out=None, **kwargs):
        definition = getattr(ops, op)
        if len(args) > len(definition.signature.parameters) and isinstance(args[-1], bool):
            args = args[:-1]
        return definition(*args, **kwargs)
    rule.__name__ = rule.__qualname__ = op
    if functions:
        register_function(*functions, check=no_out)(rule)
    if methods:
        register_method(*methods)(rule)
    return rule


def is_tensor(value) -> bool:
    return isinstance(value, Tensor)


def dims_arg(dims) -> tuple:
    """`permute(0, 2, 1)` and `permute((0, 2, 1))` alike: the varargs as one tuple."""
    return tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)


def counted(boundaries, values, right: bool, dtype):
    """For each value, how many boundaries lie below it (at or below, with `right`), along the
    last dim of `boundaries` (1-D boundaries serve every value)."""
    below = ops.le if right else ops.lt
    if boundaries.shape[-1] == 0:
        return ops.full(values.shape, 0, dtype=dtype, device=values.device)
    if boundaries.ndim == 1:
        hits = below(boundaries, ops.unsqueeze(values, -1))
    else:
        hits = below(ops.unsqueeze(boundaries, -2), ops.unsqueeze(values, -1))
    return ops.sum(hits, -1, dtype=dtype)
