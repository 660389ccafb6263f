"""The fx interpreter: a torch.fx graph to Kiln operators, node by node, through the rules.

It reads both kinds of graphs dynamo produces: the default one, where nn.Modules are inlined
into function calls and parameters arrive as inputs, and graphs with call_module nodes
(torch.fx.symbolic_trace, or dynamo with inlining of built-in modules turned off). Given
symbolic inputs it records a FlowGraph; given concrete ones it runs each operator at once.

Values between nodes are Kiln tensors, complex tensors as their real pairs
(`kiln.frontend.torch.complex.ComplexTensor`), or plain Python values (ints, tuples, dtypes); a
complex graph output is a MappingError. In-place
methods and functions (`x.add_(y)`, `operator.iadd`, `inplace=True`, `x[i] = v`) compute a new
tensor (of the changed tensor's dtype) and rebind the mutated node and the nodes that alias it through in-place calls, so later
nodes read the updated value; `mutated_inputs` tells the caller which inputs to write back.
Views (`y = x[0]; y.add_(1)` changing x) are not tracked: the backend hands graphs that change
a tensor through a view to PyTorch (`kiln.frontend.torch.aliasing`).

Inside torch.autocast regions (`kiln.frontend.torch.autocast`) a node's floating inputs are cast
to the dtype PyTorch produced for it. Calls with no effect on values (`NO_EFFECT_CALLS`: usage
logging, grad mode) are skipped, and
shape arithmetic (`SHAPE_FUNCTIONS`: torch.Size, sym_size and the sym_* helpers) runs in Python
on the sizes of the run: a graph dynamo traced with SymInts is interpreted at each size, its
symbolic sizes being `kiln.ir.size.SymSize`s (ints that keep their expression), so that
kernels can take them as arguments. Each rule's result is checked against dynamo's metadata (`node.meta`): a tensor of
another shape or dtype than PyTorch's is a `RuleResultError` naming the rule and its plugin.

Kiln's values have no strides; a rule whose meaning depends on how an argument lies in memory
(`aten.as_strided` reads its input's storage) asks `traced_argument(k)` for the tensor PyTorch
traced that argument as, with the strides and storage offset of the trace.
"""
from __future__ import annotations

import builtins
import contextlib
import contextvars
import inspect
import math
import operator
from collections import Counter
from typing import Callable

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate, map_arg

from kiln.frontend.torch.autocast import REGION_CALLS, Regions
from kiln.frontend.torch.complex import SUPPORTED, ComplexTensor, unsupported_complex
from kiln.frontend.torch.errors import UnmappedOperator, target_name
from kiln.frontend.torch.sizes import symbolic_size
from kiln.frontend.torch.registry import FUNCTION, METHOD, MODULE, MappingRegistry, mapping_registry
from kiln.graph import Role, tracing
from kiln.plugins import registry as plugin_registry
from kiln.tensor import Tensor, from_torch

_PYTHON_MODULES = {operator.__name__, math.__name__, builtins.__name__, "_operator"}
_INPLACE_OPERATORS = {getattr(operator, n) for n in dir(operator) if n.startswith("i") and
                      n[1:] in dir(operator)}


NO_EFFECT_CALLS = frozenset({
    torch._C._log_api_usage_once,       # usage telemetry (torchvision, transformers)
    torch._C._log_api_usage_metadata,
    torch._C._set_grad_enabled,         # grad mode: Kiln computes no gradients either way
})
"""Calls that never change a value: the interpreter drops them and they are never unmapped."""


def _no_effect(target) -> bool:
    """A call in NO_EFFECT_CALLS, or dynamo's helper that lowers a tensor's version counter
    after `p.data = ...` (a function made anew at each trace)."""
    return target in NO_EFFECT_CALLS or (getattr(target, "__name__", None) == "_lower_version_count_by_1"
                                         and getattr(target, "__module__", "").startswith("torch._dynamo"))


SHAPE_FUNCTIONS = frozenset({
    torch.Size, torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not,
    torch.sym_ite, torch.sym_sum, torch._sym_sqrt, torch._check, torch._check_is_size,
    torch.ops.aten._assert_scalar.default,      # dynamo's runtime checks of sizes
})
"""Shape arithmetic on Python ints and SymInts, run as Python at each size (on SymSizes)."""

_SIZE_QUERIES = {
    torch.ops.aten.sym_size.int: lambda t, dim: t.shape[dim],
    torch.ops.aten.sym_numel.default: lambda t: math.prod(t.shape),
}


_translating: contextvars.ContextVar[Node | None] = contextvars.ContextVar("kiln_translating",
                                                                          default=None)


def traced_argument(position: int):
    """What PyTorch traced positional argument `position` of the node being translated as: for a
    tensor, a (fake) torch tensor with the shape, dtype, strides and storage offset of the trace.
    None outside a rule (or its check), for an argument that is no graph value, or where the
    graph holds no metadata."""
    node = _translating.get()
    if node is None or position >= len(node.args) or not isinstance(node.args[position], Node):
        return None
    return _expected_meta(node.args[position])


FALLBACK_HINT = "; to run it in PyTorch: kiln.torch.dynamo_config.fallback_to_eager(True)"


class MappingError(NotImplementedError):
    """Every rule for a node declined its arguments (or a rule failed on them)."""


class Unrepresentable:
    """A value Kiln cannot hold (a tensor of a dtype it does not support), standing in for it
    where a graph is interpreted to find what Kiln can compile."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}: not representable in Kiln>"


def _reads_unrepresentable(args, kwargs) -> bool:
    found = []
    map_aggregate((args, kwargs), lambda v: found.append(v) if isinstance(v, Unrepresentable) else v)
    return bool(found)


class RuleResultError(RuntimeError):
    """A mapping rule returned a tensor whose shape or dtype differs from PyTorch's."""


def _is_tensor(value) -> bool:
    return isinstance(value, (Tensor, ComplexTensor, torch.Tensor))


NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim"}
"""Keyword arguments under numpy's names that PyTorch's argument parser takes for its own
(`x.mean(axis=2, keepdims=True)`, as I-BERT writes it), by the name the rules take."""


def _torch_names(kwargs: dict) -> dict:
    """`kwargs` with NUMPY_NAMES under PyTorch's names (where the call does not name both)."""
    if not any(k in kwargs for k in NUMPY_NAMES):
        return kwargs
    return {(NUMPY_NAMES[k] if k in NUMPY_NAMES and NUMPY_NAMES[k] not in kwargs else k): v for k, v in kwargs.items()}


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


def mutates(node: Node) -> bool:
    """Whether the node changes its first argument in place (`add_`, `+=`, `inplace=True`,
    `x[i] = v`, `torch.Tensor.set_(x, y)` as dynamo writes `p.data = y`)."""
    if node.op == "call_method":
        return _in_place_name(node.target)
    return node.op == "call_function" and (node.target in _INPLACE_OPERATORS or
                                           node.target is operator.setitem or
                                           node.kwargs.get("inplace") is True or
                                           (getattr(node.target, "__objclass__", None) is torch._C.TensorBase
                                            and _in_place_name(node.target.__name__)))


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def _expected_meta(node: Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _concrete(size, bindings: dict):
    """An int for a dimension of dynamo's metadata (a SymInt resolved through `bindings`, the
    run's sizes by symbol: a SymSize where `kiln.frontend.torch.sizes` reads its expression),
    or None where it cannot be resolved."""
    if isinstance(size, int):
        return size
    expr = getattr(getattr(size, "node", None), "expr", None)
    if expr is None:
        return None
    found = symbolic_size(expr, {str(symbol): value for symbol, value in bindings.items()})
    if found is not None:
        return found
    try:
        value = expr.xreplace(bindings)
    except TypeError:
        return None
    if isinstance(value, int):      # the expression was one symbol, replaced by its int
        return value
    return int(value) if value.is_number else None


def _describe(value) -> str:
    if isinstance(value, (Tensor, ComplexTensor)):
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
        return [name, name[:-1]] if _in_place_name(name) else [name]

    def is_mapped(self, node: Node) -> bool:
        """Whether a rule (or plain Python, for operator/math/builtins on non-tensors) handles it."""
        if node.op not in ("call_function", "call_method", "call_module"):
            return True
        kind, target = self.kind_and_target(node)
        if kind == FUNCTION and (_no_effect(target) or target in SHAPE_FUNCTIONS or
                                 target in _SIZE_QUERIES or target in REGION_CALLS):
            return True
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

    def run(self, inputs, on_node: Callable[[Node, object], None] | None = None,
            on_error: Callable[[Node, MappingError], object] | None = None):
        """Interpret the graph on `inputs` (one per placeholder); return the output structure.

        `on_node(node, value)` sees each node's value. Where a node cannot be translated (no
        rule, every rule declines, or it reads an `Unrepresentable` value) `on_error(node,
        error)` gives the value to go on with; without it the MappingError is raised. With a
        symbolic input the run records a graph (`kiln.graph.tracing`), where large values
        computed from no data (fills, ranges) stay nodes instead of becoming constants."""
        building = any(isinstance(v, Tensor) and v.is_symbolic for v in inputs)
        with tracing() if building else contextlib.nullcontext():
            return self._run(inputs, on_node, on_error)

    def _run(self, inputs, on_node, on_error):
        env: dict[Node, object] = {}
        aliases: dict[Node, list[Node]] = {}  # nodes that are one tensor, mutated in place
        placeholders = iter(inputs)
        self._bindings = {}
        self._autocast = Regions()
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                value = next(placeholders)
                self._bind_sizes(_expected_meta(node), value)
            elif node.op == "get_attr":
                value = self._attribute(node.target)
            elif node.op == "output":
                positions = {n: k for k, n in enumerate(self.gm.graph.find_nodes(op="placeholder"))}
                self.mutated_inputs = {positions[n]: env[n] for n in aliases if n in positions}
                if on_error is None:
                    _check_real_outputs(node, env)
                return map_arg(node.args[0], env.__getitem__)
            else:
                args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
                args, kwargs = map_aggregate((args, kwargs), _as_kiln)
                try:
                    if _reads_unrepresentable(args, kwargs):
                        raise MappingError(f"{node.format_node()} reads a value Kiln cannot "
                                           "represent (computed in PyTorch)")
                    value = self._call(node, args, kwargs)
                except MappingError as exc:
                    if on_error is None:
                        raise
                    value = on_error(node, exc)
                if mutates(node) and isinstance(node.args[0], Node):
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

    def _bind_sizes(self, meta, value) -> None:
        """Record the run's size of each symbol of a placeholder's metadata (SymInt inputs,
        symbolic dimensions of tensor inputs), to resolve later nodes' expected shapes."""
        if isinstance(meta, torch.SymInt) and isinstance(value, int):
            pairs = [(meta, value)]
        elif isinstance(meta, torch.Tensor) and _is_tensor(value) and meta.dim() == len(value.shape):
            pairs = list(zip(meta.shape, value.shape))
        else:
            return
        for size, actual in pairs:
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is not None and expr.is_symbol:
                self._bindings[expr] = int.__int__(actual)     # an int sympy takes, not a read (`_concrete`)

    def _attribute(self, path: str):
        value = self.gm
        for part in path.split("."):
            value = getattr(value, part)
        return _as_kiln(value)

    def _call(self, node: Node, args, kwargs):
        token = _translating.set(node)
        try:
            return self._translate(node, args, kwargs)
        finally:
            _translating.reset(token)

    def _translate(self, node: Node, args, kwargs):
        kind, target = self.kind_and_target(node)
        if kind == MODULE:
            return self._call_module(node, args, kwargs)
        if kind == FUNCTION and _no_effect(target):
            return None
        if kind == FUNCTION and target in REGION_CALLS:
            return self._autocast.call(target, args)
        if kind == FUNCTION and target in _SIZE_QUERIES:
            return _SIZE_QUERIES[target](*args, **kwargs)
        if kind == FUNCTION and target in SHAPE_FUNCTIONS:
            return target(*args, **kwargs)
        kwargs = _torch_names(kwargs)
        targets = self._method_targets(target) if kind == METHOD else [target]
        for t in targets:
            rule = self.registry.resolve(kind, t, args, kwargs)
            if rule is not None:
                return self._apply(node, rule, rule.handler, args, kwargs)
        if not _has_tensor(args, kwargs):
            if kind == METHOD:
                return getattr(args[0], target)(*args[1:], **kwargs)
            if _python_function(target):
                return target(*args, **kwargs)
        raise self._declined(node, kind, target, args, kwargs)

    def _call_module(self, node: Node, args, kwargs):
        found = self._wrappers.get(node.target)
        if found is None:
            module = self.gm.get_submodule(node.target)
            rule = next((r for r in self.registry.candidates(MODULE, type(module))
                         if r.accepts((module, *args), kwargs)), None)
            if rule is None:
                raise self._declined(node, MODULE, type(module), args, kwargs)
            found = self._wrappers[node.target] = (rule, rule.handler(module))
        return self._apply(node, found[0], found[1], args, kwargs)

    def _apply(self, node: Node, rule, handler, args, kwargs):
        args, kwargs = self._autocast.cast_inputs(_expected_meta(node), args, kwargs)
        try:
            value = handler(*args, **kwargs)
        except NotImplementedError:
            raise
        except Exception as exc:
            if any(isinstance(v, ComplexTensor) for v in (*args, *kwargs.values())):
                raise MappingError(f"no Kiln rule for {node.format_node()} takes its complex arguments "
                                   f"{_describe(args)} ({SUPPORTED}; the rule tried said "
                                   f"{type(exc).__name__}: {exc}){FALLBACK_HINT}") from exc
            raise MappingError(f"the Kiln rule for {node.format_node()} failed on "
                               f"{_describe(args)} {_describe(kwargs) if kwargs else ''}: "
                               f"{type(exc).__name__}: {exc}{FALLBACK_HINT}") from exc
        if mutates(node) and isinstance(value, Tensor) and isinstance(args[0], Tensor) \
                and value.dtype != args[0].dtype:
            # the rule computes the call out of place; in place, the result takes the dtype of
            # the tensor it is written to (`x.add_(y)` keeps x's float16 where y is float32)
            value = plugin_registry().implementing(Role.CAST)(value, args[0].dtype.torch_dtype)
        self._check_result(node, rule, value)
        return value

    def _check_result(self, node: Node, rule, value) -> None:
        """Raise RuleResultError where the rule's tensors differ in shape or dtype from what
        dynamo recorded for the node (nodes without metadata are not checked), so that a
        wrong value is blamed on the rule that made it, not on a later node's."""
        expected = _expected_meta(node)
        if expected is None:
            return
        got, want = [], []
        map_aggregate(value, got.append)
        map_aggregate(expected, want.append)
        for actual, meta in zip(got, want):
            if not (isinstance(actual, (Tensor, ComplexTensor)) and isinstance(meta, torch.Tensor)):
                continue
            shape = tuple(_concrete(d, self._bindings) for d in meta.shape)
            same_shape = len(shape) == len(actual.shape) and all(
                e is None or e == a for e, a in zip(shape, actual.shape))
            dtype = actual.dtype if isinstance(actual, ComplexTensor) else actual.dtype.torch_dtype
            if not same_shape or dtype != meta.dtype:
                source = (f"plugin '{rule.plugin}'" if rule.plugin else
                          f"declared in {getattr(rule.handler, '__module__', '?')}")
                torch_sig = (f"{str(meta.dtype).replace('torch.', '')}"
                             f"{['?' if d is None else d for d in shape]}")
                raise RuleResultError(
                    f"the Kiln rule {getattr(rule.handler, '__qualname__', rule.handler)} for "
                    f"{rule.name} ({source}) returned {actual.signature()} for "
                    f"{node.format_node()}, where PyTorch gives {torch_sig}")

    def _declined(self, node: Node, kind: str, target, args, kwargs) -> MappingError:
        name = target_name(kind, target)
        if not self.registry.has(kind, target):
            return MappingError(f"no Kiln rule maps {name} ({node.format_node()})")
        hint = FALLBACK_HINT
        if self._in_training_mode(node, kind, target, args, kwargs):
            hint = ("; training mode (training=True: running statistics updated, random dropout) is not "
                    "supported by Kiln: call model.eval(), or run such operators in PyTorch with "
                    "kiln.torch.dynamo_config.fallback_to_eager(True)")
        arguments = f"{_describe(args)} {_describe(kwargs) if kwargs else ''}".rstrip()
        return MappingError(f"every Kiln rule for {name} declined the arguments {arguments}{hint}")

    def _in_training_mode(self, node: Node, kind: str, target, args, kwargs) -> bool:
        """Whether the call asks for training-mode behaviour (`training=True`, or a module
        in train mode)."""
        if kind == MODULE:
            return bool(getattr(self.gm.get_submodule(node.target), "training", False))
        if kind != FUNCTION:
            return False
        try:
            bound = inspect.signature(target).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return kwargs.get("training") is True
        return bound.arguments.get("training") is True


def _check_real_outputs(output: Node, env: dict) -> None:
    """Raise MappingError where a graph output is complex (Kiln returns real tensors only)."""
    for node in output.all_input_nodes:
        found = []
        map_aggregate(env[node], lambda v: found.append(v) if isinstance(v, ComplexTensor) else v)
        if found:
            raise MappingError(unsupported_complex(f"the graph output {node.format_node()}",
                                                   found[0].signature()))


def _as_kiln(value):
    """torch tensors inside arguments (constants) become Kiln tensors sharing their memory (a
    complex one a `ComplexTensor` of its real and imaginary parts)."""
    if isinstance(value, torch.Tensor) and value.is_complex():
        return ComplexTensor(from_torch(torch.view_as_real(value.resolve_conj())))
    return from_torch(value) if isinstance(value, torch.Tensor) else value
