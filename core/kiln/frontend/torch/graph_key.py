"""The key of the whole-graph cache: what a compiled graph's plan depends on, hashed.

`graph_key(gm, args, sizes, constant, reads, settings)` hashes four things:

- the graph: every node of the fx graph with its op, name, target, arguments and what dynamo
  recorded of its value (shapes, strides, dtypes); targets by their qualified names (a Python
  function also by its code, closure and defaults), tensors and modules the graph holds as
  attributes (symbolic_trace graphs) by their contents, values included;
- the call: each argument's shape (its symbolic sizes as such), strides, dtype and device,
  whether it is a constant of the graph, and the values the graph reads as numbers (`reads`);
- the settings: the compile's (`settings`: dynamo_config's, torch.compile's, the environment's
  and a PassContext's config, but those that change no plan: `Settings.keyed`), the current
  PassContext's opt level and passes, torch's default dtype and grad mode;
- the code: the versions of Kiln, torch and Python, a hash of Kiln's own files, every installed
  plugin's distribution, version, whether it is disabled and a hash of its package's files (a
  changed source is a new key, whatever the installed version says), the C compiler and the
  CPU, the GPUs. Plugins are found by their entry points and packages, not loaded: a hit needs
  no plugin (plugins a loaded registry gained by `Registry.add_plugin` count too).

The constants' values are not hashed: the graph cache checks the values of those a compile
read (`kiln.frontend.torch.graph_cache`). What the key cannot describe raises `Uncacheable`
with the reason: an argument of an unknown type, a PassContext with instruments, mapping rules
declared outside a plugin or plugins' rules removed (code no version describes).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import marshal
import os
import platform
import sys
import threading
import weakref
from pathlib import Path

import torch
from torch.fx import GraphModule, Node

import kiln.version
from kiln.frontend.torch.registry import rules_edited
from kiln.ir.size import size_key
from kiln.passes import PassContext
from kiln import plugins
from kiln.plugins import Registry
from kiln.runtime.cpu import BuildError, compiler
from kiln.settings import Settings

_PLAIN = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), torch.dtype,
          torch.device, torch.layout, torch.memory_format)


class Uncacheable(Exception):
    """What makes a compile impossible to key (the graph cache then compiles it uncached)."""


def graph_key(gm: GraphModule, args, sizes, constant, reads, settings: Settings) -> str:
    """The hex key of compiling `gm` for `args` (`sizes`: their sizes as
    `kiln.frontend.torch.sizes.input_sizes` gives them; `constant[k]`: whether placeholder k is a
    constant of the graph; `reads`: the positions whose values the graph reads as numbers)
    under `settings`; raises Uncacheable where it cannot be keyed."""
    parts = (_graph_digest(gm), _call_text(args, sizes, constant, reads), _settings_text(settings),
             _code_digest())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


# per GraphModule (a graph is not edited once handed to the backend): its digest, or why none
_graph_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _graph_digest(gm: GraphModule) -> str:
    with _lock:
        found = _graph_digests.get(gm)
    if found is None:
        try:
            found = _sha("\n".join(_node_text(gm, node) for node in gm.graph.nodes))
        except Uncacheable as why:
            found = why
        with _lock:
            _graph_digests[gm] = found
    if isinstance(found, Uncacheable):
        raise found
    return found


def _node_text(gm: GraphModule, node: Node) -> str:
    if node.op == "call_module":
        target = _module_text(gm.get_submodule(node.target))
    elif node.op == "get_attr":
        target = _value_text(_attribute(gm, node.target))
    elif node.op == "call_function":
        target = _callable_text(node.target)
    else:
        target = repr(node.target)
    meta = node.meta.get("val", node.meta.get("example_value"))
    return (f"{node.op} {node.name} {target} {_value_text(node.args)} {_value_text(node.kwargs)} "
            f"{_meta_text(meta)}")


def _attribute(gm: GraphModule, target: str):
    value = gm
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _module_text(module: torch.nn.Module) -> str:
    """A module by its class, its repr (its configuration), its plain public attributes and its
    parameters' and buffers' contents."""
    plain = {k: v for k, v in vars(module).items()
             if not k.startswith("_") and isinstance(v, _PLAIN + (tuple, list))}
    state = [(name, _tensor_text(t, values=True))
             for name, t in (*module.named_parameters(), *module.named_buffers())]
    return f"module {_qualified(type(module))} {module!r} {_value_text(plain)} {state}"


def _qualified(obj) -> str:
    module = getattr(obj, "__module__", None) or getattr(getattr(obj, "__objclass__", None), "__module__", None)
    name = getattr(obj, "__qualname__", None)
    if module is None or name is None:
        raise Uncacheable(f"the graph calls {obj!r}, which has no qualified name")
    return f"{module}.{name}"


def _callable_text(fn, seen: frozenset = frozenset()) -> str:
    """A call target by its qualified name; a Python function also by its code, defaults and
    closure (two functions of one name in different scopes, or a lambda's captured values;
    `seen`: the functions whose closures hold this one, named only)."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op {fn}"
    if isinstance(fn, torch._ops.HigherOrderOperator):
        return f"higher-order op {fn.name()}"
    if isinstance(fn, functools.partial):
        return (f"partial({_callable_text(fn.func, seen)}, {_value_text(fn.args, seen)}, "
                f"{_value_text(fn.keywords, seen)})")
    text = _qualified(fn)
    bound = getattr(fn, "__self__", None)
    # a pybind11 function's __self__ is its own record (of type module pybind11_builtins), no object
    if (bound is not None and not inspect.ismodule(bound) and not isinstance(bound, type)
            and type(bound).__module__ != "pybind11_builtins"):
        text += f" of {_value_text(bound, seen)}"
    if inspect.isfunction(fn) and id(fn) not in seen:
        seen = seen | {id(fn)}
        closure = [_cell_text(cell, seen) for cell in fn.__closure__ or ()]
        text += (f" code {_sha(marshal.dumps(fn.__code__))} defaults {_value_text(fn.__defaults__, seen)} "
                 f"{_value_text(fn.__kwdefaults__, seen)} closure {closure}")
    return text


def _cell_text(cell, seen: frozenset) -> str:
    try:
        return _value_text(cell.cell_contents, seen)
    except ValueError:          # an empty cell
        return "empty"


def _value_text(value, seen: frozenset = frozenset()) -> str:
    """An argument of a node (or an attribute) as text that tells every distinct value apart
    (`seen`: see `_callable_text`)."""
    if isinstance(value, Node):
        return f"%{value.name}"
    if isinstance(value, torch.Tensor):
        return _tensor_text(value, values=True)
    if isinstance(value, torch.nn.Module):
        return _module_text(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_value_text(v, seen) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_value_text(k, seen)}: {_value_text(v, seen)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_value_text(value.start)}, {_value_text(value.stop)}, {_value_text(value.step)})"
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__} {value!r}"
    if callable(value):
        return _callable_text(value, seen)
    raise Uncacheable(f"the graph holds a value of type {type(value).__name__}, which the key cannot describe")


def _tensor_text(t: torch.Tensor, values: bool) -> str:
    """A tensor by its metadata (sizes and strides as dynamo's symbols where symbolic), and by a
    hash of its values with `values`."""
    text = (f"tensor {list(map(str, t.shape))} {list(map(str, t.stride()))} {t.dtype} "
            f"{t.device} {t.requires_grad}")
    return f"{text} {tensor_digest(t)}" if values else text


def tensor_digest(t: torch.Tensor) -> str:
    """A hash of a tensor's shape, dtype and values."""
    if t.layout != torch.strided or t.is_quantized:
        raise Uncacheable(f"the key cannot describe a {t.layout} tensor{' (quantized)' if t.is_quantized else ''}")
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    h = hashlib.sha256(f"{list(t.shape)} {t.dtype}".encode())
    h.update(memoryview(data))
    return h.hexdigest()


def _meta_text(meta) -> str:
    """What dynamo recorded of a node's value: a fake tensor's metadata, a SymInt's expression."""
    if isinstance(meta, torch.Tensor):
        return _tensor_text(meta, values=False)
    if isinstance(meta, (list, tuple)):
        return f"[{', '.join(_meta_text(m) for m in meta)}]"
    if isinstance(meta, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool, type(None))):
        return f"{type(meta).__name__} {meta}"
    return type(meta).__name__


def _call_text(args, sizes, constant, reads) -> str:
    parts = []
    for k, (arg, size) in enumerate(zip(args, sizes)):
        if isinstance(arg, torch.Tensor):
            parts.append(f"{'constant' if constant[k] else 'input'} {repr(size_key(tuple(size)))} "
                         f"{_tensor_text(arg, values=False)}")
        else:
            parts.append(f"value {repr(size_key(size))} {_value_text(arg)}")
    parts += [f"reads {k} {args[k].item()!r}" for k in reads]
    return "\n".join(parts)


def _settings_text(settings: Settings) -> str:
    context = PassContext.current()
    if context.instruments:
        raise Uncacheable("the PassContext has instruments, which watch the passes a hit would skip")
    return repr((sorted(settings.keyed().items()), context.opt_level, sorted(context.required_passes),
                 sorted(context.disabled_passes), str(torch.get_default_dtype()), torch.is_grad_enabled()))


_code_digests: tuple[object, str] | None = None


def _code_digest() -> str:
    """A hash of the code that compiles a graph: Kiln's, the installed plugins' (found by their
    entry points, without loading them, and any plugin a loaded registry gained besides),
    torch's and Python's versions, the machine's compilers and processors; the mapping rules
    must be the plugins' own."""
    global _code_digests
    if rules_edited():
        raise Uncacheable("mapping rules declared outside a plugin (or plugins' rules removed) are in "
                          "effect, and no version describes their code")
    found = plugins.installed()
    with _lock:     # the entry points are read once per discovery (`kiln.plugins.reload`)
        if _code_digests is None or _code_digests[0] is not plugins.entry_points():
            lines = [f"kiln {kiln.version.VERSION} {_files_digest(str(Path(kiln.version.__file__).parent))}",
                     f"torch {torch.__version__} python {sys.version}", _machine_text()]
            lines += [f"plugin {info.name} {info.distribution} {info.version} "
                      f"{_package_digest(ep.module.split('.')[0])}" for ep, info in found]
            _code_digests = (plugins.entry_points(), _sha("\n".join(lines)))
        digest = _code_digests[1]
    # which are disabled now, and the plugins a loaded registry gained by `Registry.add_plugin`
    states = [f"{info.name} disabled {info.disabled}" for _, info in found]
    reg = plugins.loaded()
    names = {info.name for _, info in found}
    added = [f"plugin {info.name} {info.distribution} {info.version} {_object_digest(info.name, reg)}"
             for info in (reg.plugins if reg is not None else []) if info.name not in names]
    return _sha("\n".join([digest, *states, *added]))


def _object_digest(name: str, reg: Registry) -> str:
    """A hash of the files of the top-level package holding the plugin object registered as
    `name` in `reg` (none where it failed to register)."""
    obj = reg.manager.get_plugin(name)
    if obj is None:
        return ""
    module = obj if inspect.ismodule(obj) else sys.modules.get(type(obj).__module__)
    if module is None:
        raise Uncacheable(f"the files of plugin {obj!r} cannot be found")
    return _package_digest(module.__name__.split(".")[0])


def _package_digest(top: str) -> str:
    """A hash of the files of the top-level package (or module) `top`, found without importing it."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    paths = list(spec.submodule_search_locations or [spec.origin]) if spec is not None else [None]
    if not all(paths):
        raise Uncacheable(f"the files of plugin package {top!r} cannot be found")
    return _sha(" ".join(_files_digest(path) for path in sorted(paths)))


@functools.lru_cache(maxsize=None)
def _files_digest(path: str) -> str:
    """A hash of a file, or of every file under a folder (but compiled Python), with their names."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(root) if p != root else p.name}\0".encode())
        h.update(p.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _machine_text() -> str:
    try:
        cc = repr(compiler())
    except BuildError:
        cc = "no C compiler"
    gpus = [(torch.cuda.get_device_name(k), torch.cuda.get_device_capability(k))
            for k in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return f"{platform.machine()} {os.cpu_count()} {cc} {gpus}"


def _sha(text) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()
