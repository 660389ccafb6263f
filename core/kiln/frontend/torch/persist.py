"""`kiln.save(compiled_model, path)` and `kiln.load(path)`: a compiled model in another process
without compiling again.

`save` takes a model compiled with `torch.compile(model, backend="kiln")` that has run: for
each graph and input signature Kiln compiled, the file holds its run as the whole-graph cache
keeps it (`kiln.frontend.torch.graph_cache.entry`: the `run_record` with the plan's kernel
programs, buffers and the constants computed while compiling, which parameters its other
constants are, the hashes of the parameters the compile read, and the compile's whole-graph
key) and the built kernels (the CPU's shared objects, the GPU's cubins).

A model captured as one graph (no graph break, no fallback_to_eager split) is saved with its
parameters and with how the model's arguments reach the graph: `load(path)` returns a
`LoadedModel`, called like the model's forward, that runs those kernels: no tracing, no graph
passes, no compiler. A model captured as several graphs runs Python between them (its own
code), which no file holds: `load(path, model=model)` returns `model` compiled by torch.compile
with a backend (`SavedGraphs`) that serves each graph dynamo traces, as `torch.compiler`'s
`save_cache_artifacts` / `load_cache_artifacts` do: dynamo traces the model again, and Kiln
finds each graph's run in the file by its whole-graph key (`kiln.frontend.torch.graph_key`:
the graph, its inputs' shapes, dtypes and devices, the settings, Kiln's, the plugins' and
torch's code) and runs it with the model's parameters, mapping, optimizing and building
nothing. Either works for a file of one graph. On a GPU, a loaded graph is captured as a CUDA
graph at its first call (where the setting `use_cuda_graph` is on), as a compiled one is.

The file is a zip archive of parts, one of which describes the others:

- `manifest.json`: the format (FORMAT) and its version (FORMAT_VERSION), the versions of Kiln
  and torch that wrote it, the architecture of each device its kernels run on (the CPU's:
  `kiln.runtime.cpu.architecture()`; a GPU's: `sm_90`, ...), and the checksum of every other
  part (`kiln.runtime.cache.checksum`: its SHA-256, or for a part over 4 MiB the SHA-256 of its
  4 MiB pieces' SHA-256s, hashed on several threads);
- `graphs.bin`: the runs (for a model of one graph, with how the model's arguments reach it) and
  the forward's parameter names, written as the graph cache writes its entries
  (`kiln.runtime.serialize`): a pickle read back building plain values and Kiln's own data
  classes only (nothing in it runs code), then the constants' raw bytes, which a load uses
  where they lie in memory (copied to their GPU);
- `kernels/SHA.so`, `kernels/SHA.cubin`: each kernel's shared object or cubin, named by its
  hash (a view step, and a GPU program that launches nothing, have none).

`load` checks the manifest before it reads anything else: the format and its version, the
architectures against this machine's, and every part against its checksum, with no part unlisted;
then it reads the runs and loads the kernels the manifest lists, and those only. A changed or
damaged file, a file of another format version or for another processor is a `LoadError`
saying which (it names the Kiln and torch versions that wrote the file; these need not match
the reader's for `load(path)`, while the keys `load(path, model=...)` finds graphs by cover
them). The hashes catch a damaged or altered part, not a forger who rewrites the
manifest as well: the kernels are machine code, so load only files you trust.

Limits, each an error where it applies: the model must be an nn.Module with parameters (they
identify its graphs; the graphs of recompilations for new shapes are all kept). A model of one
graph loaded by `load(path)` runs only the input signatures that were compiled, with the saved
parameters, and returns what the graph returns: its one output, or a tuple of them. A model of
several graphs is saved only where every graph could be keyed, and loads only with the model:
its graphs between graph breaks may read none of its parameters, so the file holds, besides
the graphs reading the model's parameters, every graph this process compiled that reads no
parameter. The model loaded must trace
to the graphs saved: its code, the torch.compile arguments (`load`'s `compile_options`),
Kiln, its plugins, torch, the settings (TF32 flags included) and the machine as they were, and
calls with the inputs (shapes, dtypes; the sequence of shapes that made dynamo's sizes
dynamic) the saved model had run; a graph the file does not hold is a LoadError at its first
call, naming its inputs. Parameters a saved compile read (batch norms folded into
convolutions, merged weights) must not have changed between that compile and `save` (call the
model once after changing them), and must have the saved values when the model loads; the
others are the model's own.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import pickle
import re
import struct
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

import torch
from torch._dynamo.resume_execution import TORCH_DYNAMO_RESUME_IN_PREFIX

from kiln.device import Device, device as as_device
from kiln.frontend.torch import graph_cache
from kiln.frontend.torch.backend import CompiledRun, KilnFunction, compiled_run, kiln_backend
from kiln.frontend.torch.run_record import RunRecord, dumps, loads
from kiln.log import logger
from kiln.runtime.backend import DeviceKernel, backend_for
from kiln.runtime import serialize
from kiln.runtime.cache import checksum, read_file
from kiln.runtime.compiled_graph import CompiledGraph, View, ViewKernel
from kiln.settings import current
from kiln.version import VERSION

FORMAT = "kiln-compiled-model"
FORMAT_VERSION = 5
MANIFEST = "manifest.json"
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")     # a zip member's local file header
_PADDING = struct.Struct("<HH")                 # an extra field's header: its tag and length
_PADDING_TAG = 0xD935                           # zipalign's tag for padding
RUNS = "graphs.bin"
_SOURCES = [(re.compile(r"L\['args'\]\[(\d+)\]$"), "position"),
            (re.compile(r"L\['kwargs'\]\['(\w+)'\]$"), "name"),
            (re.compile(r"L\['(\w+)'\]$"), "name")]
_SIZE = re.compile(r"(.*)\.size\(\)\[(\d+)\]$")


class SaveError(RuntimeError):
    """The compiled model cannot be saved (what is missing or unsupported is said)."""


class LoadError(ValueError):
    """A file `kiln.load` refuses: not a compiled model, of another format version, for another
    machine, or changed since it was saved (which is said); or, loaded with the model, a graph
    it does not hold (raised at that graph's first call)."""


def _graphs_of(module: torch.nn.Module) -> tuple[list[KilnFunction], bool]:
    """The KilnFunctions holding the graphs of `module`, and whether it is captured as several
    graphs (see the module's docstring)."""
    owned_ids = {id(t) for t in (*module.parameters(), *module.buffers())}
    if not owned_ids:
        raise SaveError("kiln.save finds a model's compiled graph by its parameters; this model "
                        "has none")
    live = KilnFunction.live()
    found = [f for f in live if f.constant_ids & owned_ids]
    if not found or not any(f.graphs for f in found):
        raise SaveError("kiln.save: the model has not been compiled by Kiln yet: call it once "
                        "(torch.compile(model, backend='kiln')(*inputs)) before saving")
    if len({f.frame for f in found}) == 1 and all(f.sources and any(f.sources) and not _at_a_break(f)
                                                  for f in found):
        return found, False     # one per recompilation of the frame (new shapes)
    return found + [f for f in live if f.graphs and not f.constant_ids], True


def _at_a_break(function: KilnFunction) -> bool:
    """Whether dynamo cut the frame of `function`'s graph at a graph break: the graph ends at
    one, or begins the rest of a frame resumed after one."""
    reason = getattr(function.gm, "compile_subgraph_reason", None)
    return reason is not None and (reason.graph_break or any(
        frame.name.startswith(TORCH_DYNAMO_RESUME_IN_PREFIX) for frame in reason.user_stack))


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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _kernel_part(program, device: Device, parts: dict[str, bytes]) -> str | None:
    """The name of the part holding the built kernel of `program` (added to `parts`), None for
    a program that builds nothing."""
    backend = backend_for(device)
    built = backend.binary(backend.load(program, device))
    if built is None:
        return None
    binary, suffix = built
    name = f"kernels/{_sha256(binary)}{suffix}"
    parts[name] = binary
    return name


def _graph_record(run: CompiledRun, sources: list | None, parts: dict[str, bytes]) -> dict:
    """`run` as the file holds it: its `graph_cache.entry`, the parts of its kernels (added to
    `parts`) and `sources`, how the model's arguments reach it (None for a graph of a model
    captured as several); a graph with sources keeps the parameters too, to run without the
    model."""
    entry = graph_cache.entry(run.record, run.constants)
    plan = (run.record if sources is not None else entry["run"]).plan
    kernels = [None if isinstance(program, View) else _kernel_part(program, device, parts)
               for program, device in plan.kernels]
    folds = entry["folds"]["plan"].kernels if entry["folds"] else []
    return {**entry, "run": replace(entry["run"], plan=plan), "kernels": kernels, "sources": sources,
            "fold_kernels": [_kernel_part(program, device, parts) for program, device in folds]}


def _keyed(runs: list[CompiledRun]) -> list[CompiledRun]:
    """`runs`, graphs of a model captured as several, one for each key."""
    unkeyed = sum(run.record.key is None for run in runs)
    if unkeyed:
        raise SaveError(f"kiln.save: this model is captured as several graphs (graph breaks or "
                        f"fallback_to_eager), saved under their whole-graph keys, and {unkeyed} of "
                        "them could not be keyed when they compiled (KILN_LOG=info logs why: mapping "
                        "rules declared outside a plugin, a PassContext with instruments, ...)")
    return list({run.record.key: run for run in runs}.values())


def _current(functions: list[KilnFunction]) -> list[tuple[KilnFunction, CompiledRun]]:
    """The runs of `functions` whose parameters have not changed since they compiled, each with
    its function (`KilnFunction.unchanged_runs`: the model's next call would compile the others
    again); SaveError where none is left."""
    current = [(function, run) for function in functions for run in function.unchanged_runs()]
    if any(function.graphs for function in functions) and not current:
        raise SaveError("kiln.save: the model's parameters changed since its graphs compiled (their "
                        "plans may hold values computed from the old ones: batch norms folded into "
                        "convolutions, merged weights): call the model once (it compiles again), then "
                        "save it")
    return current


def _architectures(graphs: list[dict]) -> dict[str, str]:
    """The architecture of the CPU and of each device the graphs' kernels run on, by device."""
    devices = {as_device("cpu")} | {device for g in graphs for _, device in g["run"].plan.kernels}
    return {str(d): backend_for(d).architecture(d) for d in sorted(devices, key=str)}


def save(compiled_model, path) -> None:
    """Write the Kiln-compiled graphs of `compiled_model` (a torch.compile'd nn.Module that has
    run) to `path`, to be restored by `kiln.load` in any process on a machine like this one (a
    model captured as several graphs: `kiln.load(path, model=model)`)."""
    module = getattr(compiled_model, "_orig_mod", compiled_model)
    if not isinstance(module, torch.nn.Module):
        raise SaveError("kiln.save takes an nn.Module compiled with torch.compile(..., "
                        f"backend='kiln'), not {type(compiled_model).__name__}")
    parameters = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    parts: dict[str, bytes] = {}
    functions, several = _graphs_of(module)
    current = _current(functions)
    if several:
        kept = {id(run) for _, run in current}
        graphs = [_graph_record(run, None, parts) for run in
                  _keyed([run for function in functions for run in function.graphs.values()]) if id(run) in kept]
    else:
        graphs = [_graph_record(run, _argument_sources(function), parts) for function, run in current]
    parts[RUNS] = dumps({"forward": parameters, "graphs": graphs})
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "kiln": VERSION,
                "torch": torch.__version__, "architecture": _architectures(graphs),
                "parts": {name: checksum(data) for name, data in sorted(parts.items())}}
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
            for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode()), *sorted(parts.items())]:
                archive.writestr(_aligned_member(name, f.tell(), len(data)), data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _aligned_member(name: str, offset: int, size: int) -> zipfile.ZipInfo:
    """A member `name` of `size` bytes whose local header, written at `offset`, is padded by an
    extra field (as Android's zipalign pads them) for its bytes to begin at a multiple of
    `serialize.ALIGNMENT`: `load` then reads the tensors of `RUNS` where they lie."""
    header = zipfile.sizeFileHeader + len(name.encode()) + _PADDING.size
    if size > zipfile.ZIP64_LIMIT:
        header += 20        # zipfile adds a ZIP64 extra field of 20 bytes
    padding = -(offset + header) % serialize.ALIGNMENT
    info = zipfile.ZipInfo(name)
    info.extra = _PADDING.pack(_PADDING_TAG, padding) + bytes(padding)
    return info


def _written_by(manifest: dict) -> str:
    return f"written by Kiln {manifest.get('kiln', '?')} with torch {manifest.get('torch', '?')}"


def _stored(contents: memoryview, info: zipfile.ZipInfo, path) -> memoryview:
    """The bytes of the archive member `info` within the archive's `contents`, uncompressed as
    `save` writes them, read in place: their checksum checks them, not zipfile's CRC as well."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise LoadError(f"{path} was changed after kiln.save wrote it: part {info.filename} is compressed")
    start = info.header_offset
    header = bytes(contents[start:start + _LOCAL_HEADER.size])
    if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise LoadError(f"{path} is damaged: part {info.filename} has no local header")
    name_length, extra_length = _LOCAL_HEADER.unpack(header)[-2:]
    begin = start + _LOCAL_HEADER.size + name_length + extra_length
    if begin + info.file_size > len(contents):
        raise LoadError(f"{path} is damaged: part {info.filename} is cut short")
    return contents[begin:begin + info.file_size]


def _checked_parts(path) -> dict[str, memoryview]:
    """The parts of the file at `path`, once its manifest is found to describe this format
    version and this machine, and every part to have the checksum it lists (else LoadError)."""
    not_ours = f"{path} is not a compiled model saved by kiln.save"
    try:
        data = read_file(path)
        archive = zipfile.ZipFile(data)
    except (ValueError, zipfile.BadZipFile):
        raise LoadError(f"{not_ours} (not a zip archive)") from None
    contents = memoryview(data)
    with archive:
        names = set(archive.namelist())
        if MANIFEST not in names:
            raise LoadError(f"{not_ours}: it has no manifest (files of Kiln's format 1, from before "
                            "manifests, must be saved again)")
        try:
            manifest = json.loads(archive.read(MANIFEST))
            listed = dict(manifest["parts"])
            architectures = dict(manifest["architecture"])
        except (ValueError, KeyError, TypeError, zipfile.BadZipFile) as error:
            raise LoadError(f"{not_ours}: its manifest is unreadable ({error})") from None
        if manifest.get("format") != FORMAT:
            raise LoadError(f"{not_ours}: its manifest names format {manifest.get('format')!r}")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise LoadError(f"{path} is in version {manifest.get('format_version')!r} of Kiln's "
                            f"compiled-model format ({_written_by(manifest)}); this Kiln ({VERSION}) "
                            f"reads version {FORMAT_VERSION}: compile and save the model again")
        for device, saved in architectures.items():
            here = _architecture_here(device)
            if saved != here:
                raise LoadError(f"{path} holds {device} kernels for {saved!r} ({_written_by(manifest)}); "
                                f"this machine's {device} is {here!r}: compile and save the model on a "
                                "machine like this one")
        unlisted = sorted(names - set(listed) - {MANIFEST})
        missing = sorted(set(listed) - names)
        problems = [f"parts its manifest does not list: {', '.join(unlisted)}"] if unlisted else []
        problems += [f"parts its manifest lists are missing: {', '.join(missing)}"] if missing else []
        if problems:
            raise LoadError(f"{path} was changed after kiln.save wrote it: {'; '.join(problems)}")
        parts = {}
        for name, digest in listed.items():
            part = _stored(contents, archive.getinfo(name), path)
            if checksum(part) != digest:
                raise LoadError(f"{path} was changed after kiln.save wrote it: part {name} does not "
                                "have the checksum its manifest lists")
            parts[name] = part
    return parts


def _architecture_here(device: str) -> str | None:
    """The architecture of this machine's `device` ('cpu', 'cuda:0'), None where it has none."""
    try:
        found = as_device(device)
        backend = backend_for(found)
    except ValueError:
        return None
    if backend.unavailable():
        return None
    return backend.architecture(found)


def _loaded_kernel(program, device: Device, binary: bytes | None, suffix: str, folder: str) -> DeviceKernel:
    """A saved kernel, loaded from its built artifact (nothing is left on disk); a step with
    none must be a program that builds nothing: the file's sources are never compiled."""
    backend = backend_for(device)
    if binary is None:
        try:
            return DeviceKernel(device, backend.from_binary(program, device, None))
        except ValueError as error:
            raise LoadError(f"the file's runs name no built kernel for a step that needs one ({error})") from None
    fd, name = tempfile.mkstemp(suffix=suffix, dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(binary)
    try:
        return DeviceKernel(device, backend.from_binary(program, device, Path(name)))
    finally:
        os.unlink(name)      # the kernel stays loaded


def _loaded_kernels(graphs: list[dict], parts: dict[str, bytes]) -> list[tuple[list, list]]:
    """Each saved graph's kernels and its fold plan's (see `graph_cache.entry`), loaded from the
    file's parts."""
    kernels = {name for g in graphs for name in (*g["kernels"], *g["fold_kernels"]) if name is not None}
    if not kernels <= set(parts):
        raise LoadError(f"the file's runs name kernels its manifest does not list: "
                        f"{', '.join(sorted(kernels - set(parts)))}")
    folder = tempfile.mkdtemp(prefix="kiln-load-")

    def loaded(programs, names) -> list[DeviceKernel]:
        return [DeviceKernel(device, ViewKernel()) if isinstance(program, View) else
                _loaded_kernel(program, device, parts.get(name), Path(name or "").suffix, folder)
                for (program, device), name in zip(programs, names)]
    try:
        return [(loaded(g["run"].plan.kernels, g["kernels"]),
                 loaded(g["folds"]["plan"].kernels if g["folds"] else [], g["fold_kernels"])) for g in graphs]
    finally:
        os.rmdir(folder)


class _LoadedGraph:
    def __init__(self, record: dict, kernels: list[DeviceKernel]):
        self.record = run = record["run"]
        plan = run.plan
        self.compiled = plan.assemble(kernels)
        self.sources = record["sources"]
        self.signature = tuple((tuple(plan.buffers[s].shape), plan.buffers[s].dtype) for s in plan.inputs)
        self._run = None

    def run(self, values: list):
        """The graph's outputs for the arguments `values`; the first call makes its CompiledRun
        (a CUDA graph captured on these arguments, where they are on a GPU)."""
        if self._run is None:
            self._run = compiled_run(self.compiled, self.record, values, current().use_cuda_graph)
        return self._run(values)


class LoadedModel:
    """A model restored by `kiln.load`: call it with the arguments of the model's forward."""

    def __init__(self, saved: dict, kernels: list[tuple[list, list]]):
        # a graph of a model saved as one holds every constant: its fold plan is not run
        self.graphs = [_LoadedGraph(g, k) for g, (k, _) in zip(saved["graphs"], kernels)]
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
            inputs = [values[p] for p in graph.record.positions]
            if tuple((tuple(t.shape), t.dtype) for t in inputs) == graph.signature:
                result = graph.run(values)
                return result[0] if isinstance(result, tuple) and len(result) == 1 else result
        given = ", ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                          for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        saved = "; ".join(", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in g.signature)
                          for g in self.graphs)
        raise ValueError(f"the loaded model was compiled for inputs {saved}, not {given}")


class SavedGraphs:
    """The torch.compile backend of `kiln.load(path, model=...)`: Kiln's backend, each graph's
    plan served from the graphs of the file at `path` (records and their loaded kernels), found
    by its whole-graph key (see `kiln.frontend.torch.backend.KilnFunction`)."""

    def __init__(self, path, graphs: list[dict], kernels: list[tuple[list, list]]):
        self.path = path
        self.graphs = {g["run"].key: (g, k) for g, k in zip(graphs, kernels) if g["run"].key is not None}

    def __call__(self, gm, example_inputs, options: dict | None = None, mode: str | None = None):
        return kiln_backend(gm, example_inputs, options, mode, saved=self)

    def served(self, key: str | None, args, inputs: str) -> tuple[CompiledGraph, RunRecord]:
        """The CompiledGraph and RunRecord of the saved graph of whole-graph `key` for the call
        `args` (its inputs described by `inputs`), bound to its parameters; LoadError where the
        file holds none."""
        if key is None:
            raise LoadError(f"{self.path}: Kiln cannot key the graph dynamo traced for inputs {inputs} "
                            "(KILN_LOG=info logs why), so no saved graph serves it")
        if key not in self.graphs:
            raise LoadError(f"{self.path} holds no graph like the one dynamo traced for inputs {inputs}: "
                            "the file was saved from another model, by another Kiln, plugins or torch, "
                            "under other settings (dynamo_config, torch.compile's mode, options and "
                            "dynamic, KILN_ variables, torch's TF32 flags) or on another machine, or the "
                            "saved model never ran on such inputs: run it on them before kiln.save")
        record, (kernels, fold_kernels) = self.graphs[key]
        logger.info("graph served from %s: %s", self.path, key)
        run = graph_cache.bound(record, args, fold_kernels)
        if run is None:
            raise LoadError(f"{self.path}: the graph for inputs {inputs} was saved with other values of "
                            f"the parameters its compile read (positions {record['run'].read} among the "
                            "graph's arguments: folded batch norms, merged weights): load the weights "
                            "the model was saved with")
        return run.plan.assemble(kernels), run


def load(path, model=None, **compile_options):
    """The compiled model `kiln.save` wrote to `path`, ready to run without compiling; its
    manifest is checked first (see the module's docstring). Without `model`: a `LoadedModel`
    (a model saved as one graph only). With `model` (the nn.Module saved, or one like it): `model`
    compiled by torch.compile with `compile_options` (torch.compile's keywords: `dynamic`,
    `mode`, `options`, as the saved model was compiled with) and a backend that serves each
    graph from the file (`SavedGraphs`)."""
    parts = _checked_parts(path)
    try:
        saved = loads(parts[RUNS])
    except pickle.UnpicklingError as error:
        raise LoadError(f"{path}: its {RUNS} holds what a compiled model does not ({error})") from None
    if model is None and any(g["sources"] is None for g in saved["graphs"]):
        raise LoadError(f"{path} holds a model captured as several graphs (graph breaks or "
                        "fallback_to_eager): the Python between them is the model's own code, so "
                        "pass the model: kiln.load(path, model=model)")
    kernels = _loaded_kernels(saved["graphs"], parts)
    if model is None:
        return LoadedModel(saved, kernels)
    return torch.compile(getattr(model, "_orig_mod", model), backend=SavedGraphs(path, saved["graphs"], kernels),
                         **compile_options)
