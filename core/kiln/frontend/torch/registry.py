"""The mapping registry: rules from torch functions, Tensor methods and nn.Module classes to Kiln.

A rule is declared with a decorator, exactly where its code is::

    @register_function(torch.nn.functional.relu, torch.relu)
    def relu(x, inplace=False):
        return ops.relu(x)

Decorators stack, and one rule may serve several torch aliases. A rule has a priority (higher
wins) and an optional `check(*args, **kwargs)` that declines arguments it cannot handle, so the
next rule for the same target is tried; among equal priorities the latest declaration wins.
A rule for an ATen overload declared with `decompose=False` takes that op whole: AOTAutograd
leaves it undecomposed in training graphs (`MappingRegistry.undecomposed`). Where torch's
decomposition of an ATen overload suits Kiln badly, `register_decomposition` gives Kiln's own,
written in torch operations (`MappingRegistry.decompositions`): AOTAutograd traces the op as
what it computes, which the partitioner sees through, unlike an op taken whole.

A decorator only builds `Rule` objects and keeps them with the module that defines the
handler (`rules_of(module, ...)` lists them). A plugin's rules take effect only by being
returned from its `kiln_torch_mappings` hook, so importing a plugin's module (a disabled or
broken plugin's included) puts no rule in effect. Rules declared outside any installed
plugin's code (a user's script, a test) take effect at once.
"""
from __future__ import annotations

import itertools
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from kiln.frontend.torch.errors import target_name
from kiln.plugins import is_plugin_module, registry
from kiln.tensor import Tensor, from_torch

FUNCTION, METHOD, MODULE, DECOMPOSITION, REWRITE = "function", "method", "module", "decomposition", "rewrite"
RULES_ATTRIBUTE = "__kiln_rules__"   # a module's own rules, in declaration order

_order = itertools.count()


@dataclass(eq=False)
class Rule:
    """One mapping: a torch target of a kind to the handler that builds Kiln operators."""

    kind: str
    target: object
    handler: Callable
    priority: int = 0
    check: Callable | None = None
    decompose: bool = True
    plugin: str = ""
    order: int = field(default_factory=lambda: next(_order))

    @property
    def name(self) -> str:
        """The rule's target, named for people: 'torch.nn.functional.relu', 'torch.Tensor.view'."""
        return target_name(self.kind, self.target)

    @property
    def key(self):
        return rule_key(self.kind, self.target)

    def accepts(self, args, kwargs) -> bool:
        """Whether the rule takes these arguments (its check passes, or it has none)."""
        return self.check is None or bool(self.check(*args, **kwargs))


def rule_key(kind: str, target):
    """Methods are keyed by name (fx's call_method target); operators of `torch.ops` by their
    name ('aten.mm.default', 'aten.mm'), so that a rule can name an operator of a library Kiln
    does not import ('transformers.grouped_mm_fallback'); other functions and modules by object."""
    if kind == METHOD and not isinstance(target, str):
        return target.__name__
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return target


class KilnModule:
    """Base class of module rules: built once per torch module, then called like its forward.

    `self.param(name)` gives a parameter or buffer of the torch module as a Kiln tensor sharing
    its memory (a constant of the traced graph).
    """

    def __init__(self, torch_module: torch.nn.Module):
        self.torch_module = torch_module

    def param(self, name: str, optional: bool = False) -> Tensor | None:
        """The parameter or buffer `name`; None if it is absent (or None) and `optional`."""
        value = getattr(self.torch_module, name, None)
        if value is None:
            if optional:
                return None
            raise AttributeError(f"{type(self.torch_module).__name__} has no parameter '{name}'")
        return from_torch(value)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define __call__")


class MappingRegistry:
    """All rules in effect, by kind and target, best first. `edited` says whether rules other
    than the plugins' own were added (declared in a script), or plugins' rules removed."""

    def __init__(self):
        self.rules: dict[tuple, list[Rule]] = {}
        self._ids: set[int] = set()
        self.edited = False

    def add(self, rule: Rule) -> None:
        """Add a rule (adding the same rule object twice has no effect)."""
        if id(rule) in self._ids:
            return
        self._ids.add(id(rule))
        self.edited |= not rule.plugin
        found = self.rules.setdefault((rule.kind, rule.key), [])
        found.append(rule)
        found.sort(key=lambda r: (-r.priority, -r.order))

    def remove(self, target, kind: str | None = None, handler=None) -> list[Rule]:
        """Remove the rules for `target` (of `kind`, or any kind; only those of `handler` if
        given) and return them; rules declared in this process are forgotten, plugins' rules
        come back on rediscovery."""
        kinds = [kind] if kind else [FUNCTION, METHOD, MODULE, DECOMPOSITION, REWRITE]
        removed = []
        for k in kinds:
            rules = self.rules.pop((k, rule_key(k, target)), [])
            kept = [r for r in rules if handler is not None and r.handler is not handler]
            removed += [r for r in rules if r not in kept]
            if kept:
                self.rules[(k, rule_key(k, target))] = kept
        gone = {id(r) for r in removed}
        self._ids -= gone
        self.edited |= bool(removed)
        with _lock:
            _declared[:] = [r for r in _declared if id(r) not in gone]
        return removed

    def candidates(self, kind: str, target) -> list[Rule]:
        """The rules for a target, in the order they are tried."""
        return self.rules.get((kind, rule_key(kind, target)), [])

    def has(self, kind: str, target) -> bool:
        return bool(self.candidates(kind, target))

    def resolve(self, kind: str, target, args, kwargs) -> Rule | None:
        """The first rule for `target` that accepts the arguments, or None."""
        return next((r for r in self.candidates(kind, target) if r.accepts(args, kwargs)), None)

    def undecomposed(self) -> set:
        """The targets that a rule declared with `decompose=False` maps whole."""
        return {r.target for rules in self.rules.values() for r in rules if not r.decompose}

    def decompositions(self) -> dict:
        """Kiln's decompositions of ATen overloads (`register_decomposition`), the best for each."""
        return {rules[0].target: rules[0].handler for (kind, _), rules in self.rules.items()
                if kind == DECOMPOSITION}

    def ties(self) -> list[tuple[str, object, list[str]]]:
        """Targets whose best rules share one priority but come from different plugins."""
        out = []
        for (kind, key), rules in self.rules.items():
            top = [r for r in rules if r.priority == rules[0].priority]
            plugins = sorted({r.plugin for r in top})
            if len(plugins) > 1:
                out.append((kind, key, plugins))
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self.rules.values())


_lock = threading.RLock()
_declared: list[Rule] = []
_live: tuple[object, MappingRegistry] | None = None


def mapping_registry() -> MappingRegistry:
    """The rules in effect: every plugin's, then every one declared in this process.

    Loads the plugins on first use; rebuilt when `kiln.plugins.reload()` rediscovers them.
    """
    global _live
    plugins = registry()
    with _lock:
        if _live is None or _live[0] is not plugins:
            reg = MappingRegistry()
            for c in plugins.contributions["torch_mappings"]:
                c.item.plugin = c.plugin.distribution
                reg.add(c.item)
            for rule in list(_declared):
                reg.add(rule)
            for kind, key, names in reg.ties():
                warnings.warn(f"Kiln: rules for {kind} {key!r} from {', '.join(names)} share "
                              "one priority; the latest loaded wins", stacklevel=2)
            _live = (plugins, reg)
        return _live[1]


def rules_edited() -> bool:
    """Whether rules other than the plugins' own are in effect (declared in this process
    outside any plugin's code), or plugins' rules were removed; the plugins are not loaded to
    say so."""
    with _lock:
        return bool(_declared) or (_live is not None and _live[1].edited)


def _declare(kind: str, targets, handler, priority: int, check, decompose: bool) -> None:
    if not targets:
        raise TypeError(f"register_{kind} needs at least one torch target")
    rules = [Rule(kind, t, handler, priority, check, decompose) for t in targets]
    module_name = getattr(handler, "__module__", None)
    module = sys.modules.get(module_name) if module_name else None
    if module is not None:
        vars(module).setdefault(RULES_ATTRIBUTE, []).extend(rules)
    if module_name and is_plugin_module(module_name):
        return      # a plugin's rule: in effect once the plugin's hook returns it
    with _lock:
        _declared.extend(rules)
        if _live is not None:
            for rule in rules:
                _live[1].add(rule)


def _register(kind: str):
    def register(*targets, priority: int = 0, check: Callable | None = None,
                 decompose: bool = True):
        def wrap(handler):
            _declare(kind, targets, handler, priority, check, decompose)
            return handler
        return wrap
    return register


register_function = _register(FUNCTION)
register_function.__doc__ = """Declare a rule for torch functions (torch.*, torch.nn.functional.*,
operator.*, math.*, aten overloads): the handler has the function's signature and receives Kiln
tensors in place of torch tensors. With `decompose=False`, AOTAutograd keeps the aten overloads
it names whole in training graphs instead of decomposing them, so the rule (which must then
take every call: no check) sees the op itself."""
register_method = _register(METHOD)
register_method.__doc__ = """Declare a rule for Tensor methods (`torch.Tensor.flatten` or the name
'flatten'): the handler's first parameter is the tensor. In-place methods (`add_`) without a
rule of their own use the rule of their out-of-place form."""
register_module = _register(MODULE)
register_module.__doc__ = """Declare a rule for nn.Module classes: the handler is a `KilnModule`
subclass, built from the torch module and called with the module's forward arguments."""


register_graph_rewrite = _register(REWRITE)
register_graph_rewrite.__doc__ = """Declare a rewrite of the dynamo graphs that go through
AOTAutograd (training): the handler receives each torch.fx Node calling one of `targets` (torch
functions, or Tensor methods such as `torch.Tensor.softmax`), with the traced values in its
`meta["example_value"]`, and returns True where it replaced the node's computation in the graph
(`kiln.frontend.torch.graph_rewrites`). It runs before autograd is traced, so that it can
change what the forward saves for the backward."""


def register_decomposition(*targets, priority: int = 0):
    """Declare Kiln's decomposition of ATen overloads `targets` in training graphs, in place of
    torch's (or of keeping the op whole): the function, with the overload's signature, computes
    its result with torch operations on the torch tensors AOTAutograd traces, so that the graph
    holds those operations (which the partitioner may recompute or leave out) and Kiln maps
    them (an op taken whole that reads a forward value only for its shape would keep that
    value saved for the backward)."""
    def wrap(fn):
        _declare(DECOMPOSITION, targets, fn, priority, None, True)
        return fn
    return wrap


def rules_of(*modules) -> list[Rule]:
    """The rules whose handlers `modules` define, in declaration order (what a plugin's
    `kiln_torch_mappings` hook returns)."""
    return [rule for m in modules for rule in vars(m).get(RULES_ATTRIBUTE, [])]
