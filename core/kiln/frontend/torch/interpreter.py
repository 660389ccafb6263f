"""The fx interpreter: a torch.fx graph to Kiln operators, node by node, through the rules.

It reads both kinds of graphs dynamo produces: the default one, where nn.Modules are inlined
into function calls and parameters arrive as inputs, and graphs with call_module nodes
(torch.fx.symbolic_trace, or dynamo with inlining of built-in modules turned off). Given
symbolic inputs it records a FlowGraph; given concrete ones it runs each operator at once.

Values between nodes are Kiln tensors or plain Python values (ints, tuples, dtypes). In-place
methods and functions (`x.add_(y)`, `operator.iadd`, `inplace=True`, `x[i] = v`) compute a new
tensor and rebind the mutated node and the nodes that alias it through in-place calls, so later
nodes read the updated value; `mutated_inputs` tells the caller which inputs to write back.
Views (`y = x[0]; y.add_(1)` changing x) are not tracked.
"""
from __future__ import annotations

import builtins
import math
import operator
from collections import Counter
from typing import Callable

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate, map_arg

from kiln.frontend.torch.errors import UnmappedOperator, target_name
from kiln.frontend.torch.registry import FUNCTION, METHOD, MODULE, MappingRegistry, mapping_registry
from kiln.tensor import Tensor, from_torch

_PYTHON_MODULES = {operator.__name__, math.__name__, builtins.__name__, "_operator"}
_INPLACE_OPERATORS = {getattr(operator, n) for n in dir(operator) if n.startswith("i") and
                      n[1:] in dir(operator)}


class MappingError(NotImplementedError):
    """Every rule for a node declined its arguments (or a rule failed on them)."""


def _is_tensor(value) -> bool:
    return isinstance(value, (Tensor, torch.Tensor))


def _has_tensor(args, kwargs) -> bool:
    found = []
    map_aggregate((args, kwargs), lambda v: found.append(v) if _is_tensor(v) else v)
    return bool(found)


def _may_take_tensor(node: Node) -> bool:
    """Whether an argument of the node is a tensor, or may be one (no dynamo metadata says)."""
    values = []
    map_arg((node.args, node.kwargs), lambda n: values.append(n.meta.get("example_value", n)) or n)
    return any(isinstance(v, (Node, torch.Tensor)) for v in values)


def _python_function(target) -> bool:
    return getattr(target, "__module__", None) in _PYTHON_MODULES or target in vars(builtins).values()


def _mutates(node: Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    return node.op == "call_function" and (node.target in _INPLACE_OPERATORS or
                                           node.target is operator.setitem or
                                           node.kwargs.get("inplace") is True)


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return value.signature()
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return repr(value)


class Interpreter:
    """Translates one torch.fx GraphModule through the mapping rules."""

    def __init__(self, gm: GraphModule, registry: MappingRegistry | None = None):
        self.gm = gm
        self.registry = registry or mapping_registry()
        self._wrappers: dict[str, object] = {}
        # after `run`: the final values of inputs changed in place, by placeholder position
        self.mutated_inputs: dict[int, object] = {}

    def kind_and_target(self, node: Node) -> tuple[str, object]:
        """The rule kind and the target a call node is looked up by."""
        if node.op == "call_module":
            return MODULE, type(self.gm.get_submodule(node.target))
        return (METHOD if node.op == "call_method" else FUNCTION), node.target

    def _method_targets(self, name: str) -> list[str]:
        inplace = name.endswith("_") and not name.endswith("__")
        return [name, name[:-1]] if inplace else [name]

    def is_mapped(self, node: Node) -> bool:
        """Whether a rule (or plain Python, for operator/math/builtins on non-tensors) handles it."""
        if node.op not in ("call_function", "call_method", "call_module"):
            return True
        kind, target = self.kind_and_target(node)
        if kind == METHOD:
            return any(self.registry.has(METHOD, t) for t in self._method_targets(target))
        if self.registry.has(kind, target):
            return True
        return kind == FUNCTION and _python_function(target) and not _may_take_tensor(node)

    def unmapped(self) -> list[UnmappedOperator]:
        """Every target of the graph that no rule maps: once each, sorted, with counts."""
        counts, examples = Counter(), {}
        for node in self.gm.graph.nodes:
            if not self.is_mapped(node):
                kind, target = self.kind_and_target(node)
                key = (target_name(kind, target), kind)
                counts[key] += 1
                examples.setdefault(key, node.format_node())
        return [UnmappedOperator(name, kind, counts[(name, kind)], examples[(name, kind)])
                for name, kind in sorted(counts)]

    def run(self, inputs, on_node: Callable[[Node, object], None] | None = None):
        """Interpret the graph on `inputs` (one per placeholder); return the output structure."""
        env: dict[Node, object] = {}
        aliases: dict[Node, list[Node]] = {}  # nodes that are one tensor, mutated in place
        placeholders = iter(inputs)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                value = next(placeholders)
            elif node.op == "get_attr":
                value = self._attribute(node.target)
            elif node.op == "output":
                positions = {n: k for k, n in enumerate(self.gm.graph.find_nodes(op="placeholder"))}
                self.mutated_inputs = {positions[n]: env[n] for n in aliases if n in positions}
                return map_arg(node.args[0], env.__getitem__)
            else:
                args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
                args, kwargs = map_aggregate((args, kwargs), _as_kiln)
                value = self._call(node, args, kwargs)
                if _mutates(node) and isinstance(node.args[0], Node):
                    same = aliases.setdefault(node.args[0], [node.args[0]])
                    for alias in same:
                        env[alias] = value
                    if node.target is operator.setitem:
                        value = None
                    else:  # an in-place call returns its (mutated) first argument
                        same.append(node)
                        aliases[node] = same
            env[node] = value
            if on_node is not None:
                on_node(node, value)
        raise ValueError("the fx graph has no output node")

    def _attribute(self, path: str):
        value = self.gm
        for part in path.split("."):
            value = getattr(value, part)
        return _as_kiln(value)

    def _call(self, node: Node, args, kwargs):
        kind, target = self.kind_and_target(node)
        if kind == MODULE:
            return self._call_module(node, args, kwargs)
        targets = self._method_targets(target) if kind == METHOD else [target]
        for t in targets:
            rule = self.registry.resolve(kind, t, args, kwargs)
            if rule is not None:
                return self._apply(node, rule.handler, args, kwargs)
        if not _has_tensor(args, kwargs):
            if kind == METHOD:
                return getattr(args[0], target)(*args[1:], **kwargs)
            if _python_function(target):
                return target(*args, **kwargs)
        raise self._declined(node, kind, target, args, kwargs)

    def _call_module(self, node: Node, args, kwargs):
        wrapper = self._wrappers.get(node.target)
        if wrapper is None:
            module = self.gm.get_submodule(node.target)
            rule = next((r for r in self.registry.candidates(MODULE, type(module))
                         if r.accepts((module, *args), kwargs)), None)
            if rule is None:
                raise self._declined(node, MODULE, type(module), args, kwargs)
            wrapper = self._wrappers[node.target] = rule.handler(module)
        return self._apply(node, wrapper, args, kwargs)

    def _apply(self, node: Node, handler, args, kwargs):
        try:
            return handler(*args, **kwargs)
        except NotImplementedError:
            raise
        except Exception as exc:
            raise MappingError(f"the Kiln rule for {node.format_node()} failed on "
                               f"{_describe(args)} {_describe(kwargs) if kwargs else ''}: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _declined(self, node: Node, kind: str, target, args, kwargs) -> MappingError:
        name = target_name(kind, target)
        if not self.registry.has(kind, target):
            return MappingError(f"no Kiln rule maps {name} ({node.format_node()})")
        return MappingError(f"every Kiln rule for {name} declined the arguments "
                            f"{_describe(args)} {_describe(kwargs) if kwargs else ''}")


def _as_kiln(value):
    """torch tensors inside arguments (constants) become Kiln tensors sharing their memory."""
    return from_torch(value) if isinstance(value, torch.Tensor) else value
