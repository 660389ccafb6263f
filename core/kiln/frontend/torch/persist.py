"""`kiln.save(compiled_model, path)` and `kiln.load(path)`: a compiled model in another process
without compiling again.

`save` takes a model compiled with `torch.compile(model, backend="kiln")` that has run: for
each input signature Kiln compiled, the file holds its run (`kiln.frontend.torch.run_record`:
the plan with the kernels' programs, the buffers and the constants, parameters and folded
tensors alike), the built kernels (the CPU's shared objects, the GPU's cubins) and how the
model's arguments reach the graph. `load` returns a `LoadedModel`, called like the model's
forward, that runs those kernels: no tracing, no graph passes, no compiler. On a GPU, a loaded
graph is captured as a CUDA graph at its first call (where the setting `use_cuda_graph` is on),
as a compiled one is.

The file is a zip archive of parts, one of which describes the others:

- `manifest.json`: the format (FORMAT) and its version (FORMAT_VERSION), the versions of Kiln
  and torch that wrote it, the architecture of each device its kernels run on (the CPU's:
  `kiln.runtime.cpu.architecture()`; a GPU's: `sm_90`, ...), and the checksum of every other
  part (`kiln.runtime.cache.checksum`: its SHA-256, or for a part over 4 MiB the SHA-256 of its
  4 MiB pieces' SHA-256s, hashed on several threads);
- `model.pt`: the runs and the forward's parameter names, in torch's serialization, read with
  its weights-only unpickler (tensors, plain values and Kiln's own data classes: nothing in it
  runs code);
- `kernels/SHA.so`, `kernels/SHA.cubin`: each kernel's shared object or cubin, named by its
  hash (a view step, and a GPU program that launches nothing, have none).

`load` checks the manifest before it reads anything else: the format and its version, the
architectures against this machine's, and every part against its checksum, with no part unlisted;
then it reads the runs and loads the kernels the manifest lists, and those only. A changed or
damaged file, a file of another format version or for another processor is a `LoadError`
saying which (it names the Kiln and torch versions that wrote the file; these need not match
the reader's). The hashes catch a damaged or altered part, not a forger who rewrites the
manifest as well: the kernels are machine code, so load only files you trust.

Limits, each an error where it applies: the model must be an nn.Module with parameters (they
identify its graphs) captured as one graph (no graph breaks, no fallback_to_eager split; the
graphs of recompilations for new shapes are all kept). A loaded model runs only the input
signatures that were compiled, and returns what the graph returns: its one output, or a tuple
of them.
"""
from __future__ import annotations

import hashlib
import inspect
import io
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

from kiln.device import Device, device as as_device
from kiln.frontend.torch.backend import CompiledRun, KilnFunction, compiled_run
from kiln.frontend.torch.run_record import dumps, loads
from kiln.runtime.backend import DeviceKernel, backend_for
from kiln.runtime.cache import checksum
from kiln.runtime.compiled_graph import View, ViewKernel
from kiln.runtime.plan import owned
from kiln.settings import current
from kiln.version import VERSION

FORMAT = "kiln-compiled-model"
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")     # a zip member's local file header
RUNS = "model.pt"
_SOURCES = [(re.compile(r"L\['args'\]\[(\d+)\]$"), "position"),
            (re.compile(r"L\['kwargs'\]\['(\w+)'\]$"), "name"),
            (re.compile(r"L\['(\w+)'\]$"), "name")]
_SIZE = re.compile(r"(.*)\.size\(\)\[(\d+)\]$")


class SaveError(RuntimeError):
    """The compiled model cannot be saved (what is missing or unsupported is said)."""


class LoadError(ValueError):
    """A file `kiln.load` refuses: not a compiled model, of another format version, for another
    machine, or changed since it was saved (which is said)."""


def _graphs_of(module: torch.nn.Module) -> list[KilnFunction]:
    owned_ids = {id(t) for t in (*module.parameters(), *module.buffers())}
    if not owned_ids:
        raise SaveError("kiln.save finds a model's compiled graph by its parameters; this model "
                        "has none")
    found = [f for f in KilnFunction.live() if f.constant_ids & owned_ids]
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


def _graph_record(run: CompiledRun, sources: list, parts: dict[str, bytes]) -> dict:
    plan = run.record.plan
    kernels = [None if isinstance(program, View) else _kernel_part(program, device, parts)
               for program, device in plan.kernels]
    stored = replace(plan, constants={s: owned(t) for s, t in plan.constants.items()})
    return {"run": replace(run.record, plan=stored), "kernels": kernels, "sources": sources}


def _architectures(graphs: list[dict]) -> dict[str, str]:
    """The architecture of the CPU and of each device the graphs' kernels run on, by device."""
    devices = {as_device("cpu")} | {device for g in graphs for _, device in g["run"].plan.kernels}
    return {str(d): backend_for(d).architecture(d) for d in sorted(devices, key=str)}


def save(compiled_model, path) -> None:
    """Write the Kiln-compiled graphs of `compiled_model` (a torch.compile'd nn.Module that has
    run) to `path`, to be restored by `kiln.load` in any process on a machine like this one."""
    module = getattr(compiled_model, "_orig_mod", compiled_model)
    if not isinstance(module, torch.nn.Module):
        raise SaveError("kiln.save takes an nn.Module compiled with torch.compile(..., "
                        f"backend='kiln'), not {type(compiled_model).__name__}")
    parameters = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    parts: dict[str, bytes] = {}
    graphs = [_graph_record(run, _argument_sources(function), parts)
              for function in _graphs_of(module) for run in function.graphs.values()]
    parts[RUNS] = dumps({"forward": parameters, "graphs": graphs})
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "kiln": VERSION,
                "torch": torch.__version__, "architecture": _architectures(graphs),
                "parts": {name: checksum(data) for name, data in sorted(parts.items())}}
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr(MANIFEST, json.dumps(manifest, indent=1))
            for name, data in sorted(parts.items()):
                archive.writestr(name, data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


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
    data = Path(path).read_bytes()
    contents = memoryview(data)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))     # over bytes, a BytesIO copies nothing
    except zipfile.BadZipFile:
        raise LoadError(f"{not_ours} (not a zip archive)") from None
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


class _LoadedGraph:
    def __init__(self, record: dict, parts: dict[str, bytes], folder: str):
        self.record = run = record["run"]
        plan = run.plan
        kernels = [DeviceKernel(device, ViewKernel()) if isinstance(program, View) else
                   _loaded_kernel(program, device, parts.get(name), Path(name or "").suffix, folder)
                   for (program, device), name in zip(plan.kernels, record["kernels"])]
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

    def __init__(self, saved: dict, parts: dict[str, bytes]):
        kernels = {name for g in saved["graphs"] for name in g["kernels"] if name is not None}
        if not kernels <= set(parts):
            raise LoadError(f"the file's runs name kernels its manifest does not list: "
                            f"{', '.join(sorted(kernels - set(parts)))}")
        folder = tempfile.mkdtemp(prefix="kiln-load-")
        try:
            self.graphs = [_LoadedGraph(g, parts, folder) for g in saved["graphs"]]
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
            inputs = [values[p] for p in graph.record.positions]
            if tuple((tuple(t.shape), t.dtype) for t in inputs) == graph.signature:
                result = graph.run(values)
                return result[0] if isinstance(result, tuple) and len(result) == 1 else result
        given = ", ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                          for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        saved = "; ".join(", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in g.signature)
                          for g in self.graphs)
        raise ValueError(f"the loaded model was compiled for inputs {saved}, not {given}")


def load(path) -> LoadedModel:
    """The compiled model `kiln.save` wrote to `path`, ready to run without compiling; its
    manifest is checked first (see the module's docstring)."""
    parts = _checked_parts(path)
    try:
        saved = loads(parts[RUNS])
    except pickle.UnpicklingError as error:
        raise LoadError(f"{path}: its {RUNS} holds what a compiled model does not ({error})") from None
    return LoadedModel(saved, parts)
