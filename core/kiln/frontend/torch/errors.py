"""`UnmappedOperatorError` and how torch targets are named in messages."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from kiln.table import format_table

GUIDE = "CONTRIBUTING.md, section 'Mapping rules' (adding a torch mapping rule)"

_NAMESPACES = ("torch.nn.functional", "torch.nn", "torch.special", "torch.linalg", "torch.fft",
               "torch", "torch.Tensor", "operator", "math")


@functools.cache
def _public_names() -> dict[int, str]:
    """Public names of the objects in torch's namespaces, by id (the first namespace wins)."""
    names = {}
    for prefix in reversed(_NAMESPACES):
        namespace = importlib.import_module(prefix) if prefix != "torch.Tensor" else torch.Tensor
        for attr in dir(namespace):
            if not attr.startswith("_"):
                names[id(getattr(namespace, attr, None))] = f"{prefix}.{attr}"
    return names


def _own_name_in_namespaces(target) -> str | None:
    """'torch._grouped_mm' for a private builtin that a torch namespace holds under its own name
    (its module and qualified name, 'torch._VariableFunctionsClass', say nothing useful)."""
    name = getattr(target, "__name__", None)
    if not isinstance(name, str):
        return None
    for prefix in _NAMESPACES:
        namespace = torch.Tensor if prefix == "torch.Tensor" else importlib.import_module(prefix)
        if getattr(namespace, name, None) is target:
            return f"{prefix}.{name}"
    return None


def target_name(kind: str, target) -> str:
    """A readable, stable name of a torch target: 'torch.nn.functional.gelu', 'torch.Tensor.view',
    'operator.add', 'torch.nn.Conv2d', 'aten.convolution_backward.default', 'aten._grouped_mm'
    (an overload packet), 'torch._grouped_mm', 'torch.ops.higher_order.cond'."""
    if kind == "method":     # a method's name, or the method itself (torch.Tensor.addcdiv)
        return f"torch.Tensor.{target if isinstance(target, str) else target.__name__}"
    if isinstance(target, str):         # an operator overload named by a rule
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)      # 'aten.add.Tensor', 'aten.add' (not the packet's pybind11 class)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"torch.ops.higher_order.{target.name()}"
    public = _public_names().get(id(target)) or _own_name_in_namespaces(target)
    if public:
        return public
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    module = getattr(target, "__module__", None) or ""
    # C++ bindings may carry pybind11's mangled class name ('pybind11_detail_function_record_...')
    parts = [p for p in f"{module}.{name}".split(".") if p and not p.startswith("pybind11_detail")]
    return ".".join(parts)


@dataclass(frozen=True)
class UnmappedOperator:
    """A torch target no rule maps: its name, kind, how many nodes use it, and one of them."""

    name: str
    kind: str
    count: int
    example: str


class UnmappedOperatorError(NotImplementedError):
    """The graph uses torch operators that no Kiln mapping rule handles (all of them listed)."""

    def __init__(self, operators: list[UnmappedOperator]):
        self.operators = list(operators)
        table = format_table([(o.name, o.kind, f"{o.count} node{'s' if o.count > 1 else ''}")
                              for o in self.operators], indent="  ")
        super().__init__(
            f"The following torch operators are not mapped to Kiln yet:\n{table}" +
            f"\nTo add the conversion rules, see {GUIDE}.\n"
            "To run them in PyTorch instead: kiln.torch.dynamo_config.fallback_to_eager(True)")
