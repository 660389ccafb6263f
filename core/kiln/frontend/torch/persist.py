"""`kiln.save(compiled_model, path)` and `kiln.load(path)`: a compiled model in another process
without compiling again.

`save` takes a model compiled with `torch.compile(model, backend="kiln")` that has run: for
each input signature Kiln compiled, the file holds the built kernels (the shared objects
themselves), the memory plan's buffers, the constants (parameters, folded tensors) and how the
model's arguments reach the graph. `load` returns a `LoadedModel`, called like the model's
forward, that runs those kernels: no tracing, no graph passes, no compiler.

Limits, each an error where it applies: the model must be an nn.Module with parameters (they
identify its graphs) captured as one graph (no graph breaks, no fallback_to_eager split; the
graphs of recompilations for new shapes are all kept), on the CPU. A loaded model runs only
the input signatures that were compiled, and returns what the graph returns: its one output,
or a tuple of them. Loading a file runs the machine code in it: load only files you trust (as with `torch.load(weights_only=False)`).
"""
from __future__ import annotations

import inspect
import os
import re
import tempfile
from pathlib import Path

import torch
from torch.fx.node import map_aggregate

from kiln.frontend.torch.backend import KilnFunction
from kiln.runtime.compiled_graph import Buffer, CompiledGraph, Step
from kiln.runtime.cpu import CpuKernel
from kiln.tensor import Tensor
from kiln.version import VERSION

FORMAT = "kiln-compiled-model/1"
_SOURCES = [(re.compile(r"L\['args'\]\[(\d+)\]$"), "position"),
            (re.compile(r"L\['kwargs'\]\['(\w+)'\]$"), "name"),
            (re.compile(r"L\['(\w+)'\]$"), "name")]
_SIZE = re.compile(r"(.*)\.size\(\)\[(\d+)\]$")


class SaveError(RuntimeError):
    """The compiled model cannot be saved (what is missing or unsupported is said)."""


class _Output:
    """Marks where a graph output goes in the saved output structure."""


def _graphs_of(module: torch.nn.Module) -> list[KilnFunction]:
    owned = {id(t) for t in (*module.parameters(), *module.buffers())}
    if not owned:
        raise SaveError("kiln.save finds a model's compiled graph by its parameters; this model "
                        "has none")
    found = [f for f in KilnFunction.live() if f.constant_ids & owned]
    if not found or not any(f.graphs for f in found):
        raise SaveError("kiln.save: the model has not been compiled by Kiln yet: call it once "
                        "(torch.compile(model, backend='kiln')(*inputs)) before saving")
    frames = {f.frame for f in found}
    if len(frames) > 1 or any(not f.sources or not any(f.sources) for f in found):
        raise SaveError("kiln.save supports models captured as one graph; this one has "
                        "several (graph breaks or fallback_to_eager): compile with "
                        "fullgraph=True to see why")
    return found     # one per recompilation of the frame (new shapes)


def _argument_sources(function: KilnFunction) -> list:
    """For each placeholder: None for a constant, else how the model's arguments give it."""
    out = []
    placeholders = function.gm.graph.find_nodes(op="placeholder")
    for node, constant, source in zip(placeholders, function.constant, function.sources):
        if constant:
            out.append(None)
            continue
        size = _SIZE.match(source)
        found = _argument(size.group(1) if size else source)
        if found is None:
            raise SaveError(f"kiln.save: graph input {node.name} comes from {source or '?'}; "
                            "only the model's own tensor arguments and their sizes can be saved")
        out.append((*found, int(size.group(2))) if size else found)
    return out


def _argument(source: str) -> tuple | None:
    for pattern, kind in _SOURCES:
        match = pattern.match(source)
        if match:
            value = match.group(1)
            return kind, int(value) if kind == "position" else value
    return None


def _kernel_record(step: Step) -> dict:
    kernel = getattr(step.kernel, "kernel", None)
    if not isinstance(kernel, CpuKernel):
        raise SaveError("kiln.save supports CPU kernels only; this graph runs "
                        f"{type(kernel).__name__} kernels")
    return {"program": kernel.program, "binary": Path(kernel.path).read_bytes()}


def _graph_record(run) -> dict:
    compiled = run.graph.compile()
    produced = {s for step in compiled.steps for s in step.outputs}
    planned = {s for plan in compiled.plans.values() for s in plan.offsets}
    constants = {s: t for s, t in compiled.constants.items()
                 if s not in produced and s not in planned and s not in compiled.inputs}
    return {
        "kernels": [_kernel_record(step) for step in compiled.steps],
        "steps": [(step.inputs, step.outputs) for step in compiled.steps],
        "buffers": [(b.shape, b.dtype, str(b.device)) for b in compiled.buffers],
        "inputs": compiled.inputs, "outputs": compiled.outputs, "constants": constants,
        "positions": run.positions, "writeback": run.writeback,
        "structure": map_aggregate(run.structure,
                                   lambda v: _Output() if isinstance(v, Tensor) else v),
    }


def save(compiled_model, path) -> None:
    """Write the Kiln-compiled graphs of `compiled_model` (a torch.compile'd nn.Module that has
    run) to `path`, to be restored by `kiln.load` in any process on a machine like this one."""
    module = getattr(compiled_model, "_orig_mod", compiled_model)
    if not isinstance(module, torch.nn.Module):
        raise SaveError("kiln.save takes an nn.Module compiled with torch.compile(..., "
                        f"backend='kiln'), not {type(compiled_model).__name__}")
    parameters = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    graphs = [{**_graph_record(run), "sources": _argument_sources(function)}
              for function in _graphs_of(module) for run in function.graphs.values()]
    torch.save({"format": FORMAT, "kiln": VERSION, "forward": parameters,
                "graphs": graphs}, path)


def _loaded_kernel(record: dict, folder: str) -> CpuKernel:
    """A saved CPU kernel, loaded from its shared object (nothing is left on disk)."""
    fd, so = tempfile.mkstemp(suffix=".so", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(record["binary"])
    try:
        return CpuKernel(record["program"], Path(so))
    finally:
        os.unlink(so)      # the mapping stays loaded


class _LoadedGraph:
    def __init__(self, record: dict, folder: str):
        steps = [Step(_loaded_kernel(k, folder), tuple(ins), tuple(outs))
                 for k, (ins, outs) in zip(record["kernels"], record["steps"])]
        buffers = [Buffer(tuple(shape), dtype, torch.device(device))
                   for shape, dtype, device in record["buffers"]]
        self.compiled = CompiledGraph(steps, buffers, record["inputs"], record["outputs"],
                                      record["constants"])
        self.sources = record["sources"]
        self.positions = record["positions"]
        self.writeback = record["writeback"]
        self.structure = record["structure"]
        self.signature = tuple((tuple(buffers[s].shape), buffers[s].dtype) for s in record["inputs"])

    def __call__(self, values: list):
        outs = self.compiled.run([values[p] for p in self.positions])
        if self.writeback:
            changed, outs = outs[-len(self.writeback):], outs[:-len(self.writeback)]
            for position, value in zip(self.writeback, changed):
                values[position].copy_(value)
        outs = iter(outs)
        return map_aggregate(self.structure, lambda v: next(outs) if isinstance(v, _Output) else v)


class LoadedModel:
    """A model restored by `kiln.load`: call it with the arguments of the model's forward."""

    def __init__(self, saved: dict):
        folder = tempfile.mkdtemp(prefix="kiln-load-")
        try:
            self.graphs = [_LoadedGraph(g, folder) for g in saved["graphs"]]
        finally:
            os.rmdir(folder)
        self.forward_names = saved["forward"]

    def _argument(self, source, args, kwargs):
        kind, key, *dim = source
        value = self._named(kind, key, args, kwargs)
        return value.shape[dim[0]] if dim else value

    def _named(self, kind, key, args, kwargs):
        if kind == "position":
            if key < len(args):
                return args[key]
            key = self.forward_names[key]
        elif key in self.forward_names and self.forward_names.index(key) < len(args):
            return args[self.forward_names.index(key)]
        if key not in kwargs:
            raise TypeError(f"the loaded model needs argument {key!r}")
        return kwargs[key]

    def __call__(self, *args, **kwargs):
        for graph in self.graphs:
            values = [None if s is None else self._argument(s, args, kwargs) for s in graph.sources]
            inputs = [values[p] for p in graph.positions]
            if tuple((tuple(t.shape), t.dtype) for t in inputs) == graph.signature:
                result = graph(values)
                return result[0] if isinstance(result, tuple) and len(result) == 1 else result
        given = ", ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                          for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        saved = "; ".join(", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in g.signature)
                          for g in self.graphs)
        raise ValueError(f"the loaded model was compiled for inputs {saved}, not {given}")


def load(path) -> LoadedModel:
    """The compiled model `kiln.save` wrote to `path`, ready to run without compiling."""
    saved = torch.load(path, weights_only=False)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(f"{path} is not a compiled model saved by kiln.save")
    return LoadedModel(saved)
