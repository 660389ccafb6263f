"""kiln.save / kiln.load: a compiled model restored in a fresh process builds no kernel, and a
file is checked against its manifest before anything in it is loaded."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
from kiln.frontend.torch import graph_cache, persist, registry as mapping_rules
from kiln.frontend.torch.graph_key import Uncacheable
from kiln.frontend.torch.persist import SaveError
from kiln.runtime import serialize
from kiln.runtime.cache import checksum
from kiln.runtime.cpu import architecture

SAVE = """
import sys, torch, kiln
from torch import nn
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
device = sys.argv[3]
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 5, 6),
                      nn.LayerNorm(6)).eval().to(device)
compiled = torch.compile(model, backend="kiln")
x, y = torch.randn(2, 3, 6, 7, device=device), torch.randn(5, 3, 6, 7, device=device)
with torch.no_grad():
    outs = [compiled(x), compiled(y)]
kiln.save(compiled, sys.argv[1])
torch.save({"inputs": [x, y], "expected": [model(x).detach(), model(y).detach()]}, sys.argv[2])
"""

LOAD = """
import sys, torch, kiln
import kiln.runtime.cpu, kiln.runtime.cuda
def no_build(*args, **kwargs):
    raise AssertionError("kiln.load built a kernel")
kiln.runtime.cpu.build_shared_library = kiln.runtime.cuda.compile_cubin = no_build
loaded = kiln.load(sys.argv[1])
io = torch.load(sys.argv[2])
for x, expected in zip(io["inputs"], io["expected"]):
    for _ in range(3):      # on a GPU: the CUDA graph's capture, then its replays
        torch.testing.assert_close(loaded(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(loaded(input=x), expected, atol=1e-4, rtol=1e-4)
print("loaded ok")
"""


def _python(script, *args, cache, **env):
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "KILN_CACHE_DIR": str(cache), "KILN_NVRTC_CHECK": "", **env})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_saved_model_runs_in_a_fresh_process_with_zero_kernel_builds(tmp_path, device):
    """On the CPU its shared objects, on a GPU its cubins come from the file: neither the C
    compiler nor NVRTC runs, and the load leaves no kernel cache behind."""
    model, io = tmp_path / "model.kiln", tmp_path / "io.pt"
    saved = _python(SAVE, model, io, device, cache=tmp_path / "cache-save")
    assert saved.returncode == 0, saved.stderr
    loaded = _python(LOAD, model, io, cache=tmp_path / "cache-load", KILN_LOG="info")
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded ok" in loaded.stdout
    assert "kernel cache miss" not in loaded.stderr and "stage build" not in loaded.stderr
    assert not (tmp_path / "cache-load").exists()       # nothing built, nothing cached


BREAKS = """
import sys, torch, kiln
from torch import nn
torch.backends.cudnn.allow_tf32 = False
device = sys.argv[-1]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        # merged into one linear over their weights concatenated while compiling: the loaded
        # graph computes that weight again from the loading model's
        self.gate, self.up, self.norm = nn.Linear(16, 4), nn.Linear(16, 4), nn.LayerNorm(4)

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        h = torch.tanh(h) * 2           # a graph that reads no parameter
        if h.sum().item() > -1e9:       # data-dependent: Python decides, between two graphs
            h = h + 1
        return self.norm(self.gate(h) * self.up(h))
"""

SAVE_BREAKS = BREAKS + """
torch.manual_seed(0)
compiled = torch.compile(Model().eval().to(device), backend="kiln")
with torch.no_grad():
    for n in (2, 5, 2):     # 5: dynamo makes the batch size dynamic; 2 again: the dynamic graphs' run for 2
        compiled(torch.randn(n, 8, device=device))
kiln.save(compiled, sys.argv[1])
"""

LOAD_BREAKS = BREAKS + """
import kiln.runtime.cpu, kiln.runtime.cuda
from kiln.frontend.torch.persist import LoadError
def no_build(*args, **kwargs):
    raise AssertionError("kiln.load built a kernel")
kiln.runtime.cpu.build_shared_library = kiln.runtime.cuda.compile_cubin = no_build
torch.manual_seed(1)        # other weights than the saved model's: the loaded graphs run the model's own
model = Model().eval().to(device)
try:
    kiln.load(sys.argv[1])
    raise AssertionError("a file of several graphs loaded without the model")
except LoadError as error:
    assert "pass the model: kiln.load(path, model=model)" in str(error), error
loaded = kiln.load(sys.argv[1], model=model)
with torch.no_grad():
    for n in (2, 5, 2, 5):
        x = torch.randn(n, 8, device=device)
        for _ in range(2):      # on a GPU: the CUDA graphs' capture, then their replays
            torch.testing.assert_close(loaded(x), model(x), atol=1e-4, rtol=1e-4)
    try:
        loaded(torch.randn(3, 8, device=device))
        raise AssertionError("a graph the file does not hold ran")
    except LoadError as error:
        print("refused:", error)
print("loaded ok")
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_model_with_graph_breaks_runs_in_a_fresh_process_from_its_saved_graphs(tmp_path, device):
    """dynamo traces the model again, and each of its graphs (one of them reads no parameter)
    is served from the file with the loading model's parameters, building no kernel; a graph
    the file does not hold (a batch size the saved model never ran) is a LoadError naming its
    inputs, and so is loading the file without the model."""
    model = tmp_path / "model.kiln"
    saved = _python(SAVE_BREAKS, model, device, cache=tmp_path / "cache-save")
    assert saved.returncode == 0, saved.stderr
    loaded = _python(LOAD_BREAKS, model, device, cache=tmp_path / "cache-load", KILN_LOG="info")
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded ok" in loaded.stdout
    assert ("refused: " + f"{model} holds no graph like the one dynamo traced for inputs 3, float32[3, 8]: "
            "the file was saved from another model") in loaded.stdout
    assert loaded.stderr.count("graph served from") >= 3      # the three graphs' runs at least
    assert "kernel cache miss" not in loaded.stderr and "stage build" not in loaded.stderr
    assert not (tmp_path / "cache-load").exists()       # nothing built, nothing cached


@pytest.fixture
def compiled():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()
    yield model, torch.compile(model, backend="kiln")
    torch._dynamo.reset()


def test_saving_a_model_that_has_not_run_is_a_clear_error(compiled, tmp_path):
    _, model = compiled
    with pytest.raises(SaveError, match="has not been compiled by Kiln yet"):
        kiln.save(model, tmp_path / "m.kiln")


def test_a_loaded_model_refuses_inputs_it_was_not_compiled_for(saved):
    path, eager, x = saved
    loaded = kiln.load(path)
    torch.testing.assert_close(loaded(x), eager(x).detach())
    with pytest.raises(ValueError, match=r"compiled for inputs float32\[2, 4\], not float32\[3, 4\]"):
        loaded(torch.randn(3, 4))


@pytest.fixture
def plugins_rules_only(monkeypatch):
    """The mapping rules the plugins' alone: rules other test modules declared leave graphs
    unkeyed, and `kiln.load(path, model=...)` finds graphs by their keys."""
    monkeypatch.setattr(mapping_rules, "_declared", [])
    monkeypatch.setattr(mapping_rules, "_live", None)


def test_a_file_of_one_graph_loads_with_the_model_too_and_runs_its_parameters(plugins_rules_only, saved,
                                                                               monkeypatch):
    path, eager, x = saved

    def no_build(*args, **kwargs):
        raise AssertionError("kiln.load built a kernel")
    monkeypatch.setattr(kiln.runtime.cpu, "build_shared_library", no_build)
    torch._dynamo.reset()
    with torch.no_grad():
        eager[0].weight.mul_(2)         # the model's own parameters, not the saved ones
        torch.testing.assert_close(kiln.load(path, model=eager)(x), eager(x))


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        h = self.linear(x)
        torch._dynamo.graph_break()
        return h.relu()


def test_a_model_with_graph_breaks_whose_graphs_cannot_be_keyed_is_not_saved(tmp_path, monkeypatch):
    """Its graphs are found by their keys when it loads: without them the file would be useless."""
    def unkeyable(*args):
        raise Uncacheable("a test's reason")
    monkeypatch.setattr(graph_cache, "graph_key", unkeyable)
    torch._dynamo.reset()
    model = torch.compile(_Broken().eval(), backend="kiln")
    with torch.no_grad():
        model(torch.randn(2, 4))
    with pytest.raises(SaveError, match="captured as several graphs .* could not be keyed when they compiled"):
        kiln.save(model, tmp_path / "m.kiln")
    torch._dynamo.reset()


def test_a_model_whose_folded_parameters_changed_since_it_compiled_is_not_saved(tmp_path):
    """The plan holds the batch norm folded from the old statistics: saved with the new ones, it
    would compute neither model."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        compiled(torch.randn(1, 3, 6, 6))
        kiln.save(compiled, tmp_path / "m.kiln")
        model[1].running_mean.add_(1)
    with pytest.raises(SaveError, match="parameters changed since its graphs compiled .*: call the model once"):
        kiln.save(compiled, tmp_path / "m.kiln")
    torch._dynamo.reset()


def test_graphs_compiled_before_the_parameters_changed_are_left_out(tmp_path):
    """The graph compiled for one batch before the statistics changed is left out; the one
    compiled for another batch since computes the model as it is."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    compiled = torch.compile(model, backend="kiln")
    old, new = torch.randn(1, 3, 6, 6), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        compiled(old)
        model[1].running_mean.add_(1)
        compiled(new)
    kiln.save(compiled, tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    with torch.no_grad():
        torch.testing.assert_close(loaded(new), model(new), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="compiled for inputs"):
            loaded(old)
    torch._dynamo.reset()


def test_load_refuses_other_files(tmp_path):
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a compiled model saved by kiln.save"):
        kiln.load(tmp_path / "other.pt")


@pytest.fixture
def saved(compiled, tmp_path):
    """A file kiln.save wrote, with the eager model and an input."""
    eager, model = compiled
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)
    kiln.save(model, tmp_path / "m.kiln")
    return tmp_path / "m.kiln", eager, x


def parts_of(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def rewrite(path, parts: dict[str, bytes], compression=zipfile.ZIP_STORED) -> None:
    """Write `parts` as the zip archive at `path` (a file changed after kiln.save wrote it)."""
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in parts.items():
            archive.writestr(name, data)


def with_manifest(parts: dict[str, bytes], **changes) -> dict[str, bytes]:
    manifest = json.loads(parts[persist.MANIFEST])
    return {**parts, persist.MANIFEST: json.dumps({**manifest, **changes}).encode()}


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Fail the test if the records are read or a kernel loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("kiln.load read the records or loaded a kernel of a refused file")
    monkeypatch.setattr(persist, "loads", refuse)
    monkeypatch.setattr(persist, "_loaded_kernel", refuse)


def test_the_manifest_names_the_format_versions_architecture_and_every_parts_hash(saved):
    path, eager, x = saved
    parts = parts_of(path)
    manifest = json.loads(parts.pop(persist.MANIFEST))
    assert manifest["format"] == "kiln-compiled-model" and manifest["format_version"] == persist.FORMAT_VERSION == 5
    assert manifest["kiln"] == kiln.__version__ and manifest["torch"] == torch.__version__
    assert manifest["architecture"] == {"cpu": architecture()}
    assert manifest["parts"] == {name: checksum(data) for name, data in parts.items()}
    assert persist.RUNS in parts and any(name.startswith("kernels/") for name in parts)
    torch.testing.assert_close(kiln.load(path)(x), eager(x).detach())


def test_every_part_begins_aligned_and_a_loaded_models_tensors_lie_in_the_files_memory(saved, monkeypatch):
    """Each part's bytes begin at a multiple of serialize.ALIGNMENT in the file, so that load
    reads the runs' CPU tensors where the file's bytes lie, copying none."""
    path, eager, x = saved
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name_length, extra_length = persist._LOCAL_HEADER.unpack_from(data, info.header_offset)[-2:]
            begin = info.header_offset + persist._LOCAL_HEADER.size + name_length + extra_length
            assert begin % serialize.ALIGNMENT == 0, info.filename
            assert data[begin:begin + info.file_size] == archive.read(info)
    memory = []
    read = persist.read_file
    monkeypatch.setattr(persist, "read_file", lambda p: memory.append(read(p)) or memory[-1])
    loaded = kiln.load(path)
    start = torch.frombuffer(memory[0], dtype=torch.uint8).data_ptr()
    constants = [t for g in loaded.graphs for t in g.record.plan.constants.values()]
    assert constants and all(start <= t.data_ptr() < start + len(memory[0]) for t in constants)
    torch.testing.assert_close(loaded(x), eager(x).detach())


@pytest.mark.parametrize("part", ["the runs", "a kernel"])
def test_a_changed_part_is_refused_before_anything_is_loaded(saved, part, nothing_loaded):
    path, _, _ = saved
    parts = parts_of(path)
    name = persist.RUNS if part == "the runs" else next(n for n in parts if n.startswith("kernels/"))
    data = bytearray(parts[name])
    data[len(data) // 2] ^= 0xFF
    rewrite(path, {**parts, name: bytes(data)})
    with pytest.raises(persist.LoadError, match=f"was changed after kiln.save wrote it: part {name} "
                                                "does not have the checksum its manifest lists"):
        kiln.load(path)


def test_a_damaged_file_is_refused(saved, nothing_loaded):
    path, _, _ = saved
    data = bytearray(path.read_bytes())
    start = data.find(b"kernels/")                 # inside the first kernel's bytes
    data[start + 4096] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(persist.LoadError, match="damaged|was changed"):
        kiln.load(path)


def test_a_file_whose_parts_were_compressed_is_refused(saved, nothing_loaded):
    path, _, _ = saved
    rewrite(path, parts_of(path), zipfile.ZIP_DEFLATED)
    with pytest.raises(persist.LoadError, match="was changed after kiln.save wrote it: part .* is compressed"):
        kiln.load(path)


def test_a_file_cut_short_is_refused(saved, nothing_loaded):
    path, _, _ = saved
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(persist.LoadError, match="not a zip archive"):
        kiln.load(path)


def test_a_part_the_manifest_does_not_list_is_refused(saved, nothing_loaded):
    path, _, _ = saved
    rewrite(path, {**parts_of(path), "kernels/extra.so": b"\x7fELF"})
    with pytest.raises(persist.LoadError, match="parts its manifest does not list: kernels/extra.so"):
        kiln.load(path)


def test_a_file_for_another_processor_is_refused(saved, nothing_loaded):
    path, _, _ = saved
    rewrite(path, with_manifest(parts_of(path), architecture={"cpu": "riscv64 Some CPU/0123"}))
    with pytest.raises(persist.LoadError, match=r"holds cpu kernels for 'riscv64 Some CPU/0123' "
                                                r"\(written by Kiln .* with torch .*\); this machine's cpu is"):
        kiln.load(path)


def test_a_file_for_a_gpu_this_machine_lacks_or_another_gpu_is_refused(saved, nothing_loaded, monkeypatch):
    """A file of GPU kernels names the GPU's architecture (sm_90): a machine without that device,
    or whose device is another architecture, refuses it before reading anything else."""
    path, _, _ = saved
    gpu = {"cpu": architecture(), "cuda:0": "sm_90"}
    rewrite(path, with_manifest(parts_of(path), architecture=gpu))
    monkeypatch.setattr(persist, "_architecture_here", lambda device: {"cpu": architecture()}.get(device))
    with pytest.raises(persist.LoadError, match=r"holds cuda:0 kernels for 'sm_90' .*this machine's cuda:0 is None"):
        kiln.load(path)
    monkeypatch.setattr(persist, "_architecture_here", lambda device: {"cpu": architecture(), "cuda:0": "sm_80"}[device])
    with pytest.raises(persist.LoadError, match=r"holds cuda:0 kernels for 'sm_90' .*this machine's cuda:0 is 'sm_80'"):
        kiln.load(path)


@pytest.mark.parametrize("version", [4, 6])
def test_a_file_of_another_format_version_is_refused(saved, version, nothing_loaded):
    path, _, _ = saved
    rewrite(path, with_manifest(parts_of(path), format_version=version))
    with pytest.raises(persist.LoadError, match=f"is in version {version} of Kiln's compiled-model "
                                                r"format .*; this Kiln .* reads version 5"):
        kiln.load(path)


def test_a_run_naming_no_built_kernel_for_a_step_is_refused_without_compiling_it(saved, monkeypatch):
    """A file whose records (and manifest, rewritten to match) leave out a step's built kernel
    would have the loader compile the program's source from the file: it is refused instead."""
    path, _, _ = saved
    parts = parts_of(path)
    runs = persist.loads(parts[persist.RUNS])
    runs["graphs"][0]["kernels"] = [None] * len(runs["graphs"][0]["kernels"])
    parts[persist.RUNS] = persist.dumps(runs)
    manifest = json.loads(parts[persist.MANIFEST])
    manifest["parts"] = {name: checksum(data) for name, data in parts.items() if name != persist.MANIFEST}
    rewrite(path, {**parts, persist.MANIFEST: json.dumps(manifest).encode()})

    def no_build(*args, **kwargs):
        raise AssertionError("kiln.load compiled a kernel from the file")
    monkeypatch.setattr(kiln.runtime.cpu, "build_shared_library", no_build)
    with pytest.raises(persist.LoadError, match="no built kernel for a step that needs one"):
        kiln.load(path)


def test_a_file_from_before_manifests_is_refused(tmp_path, nothing_loaded):
    torch.save({"format": "kiln-compiled-model/1", "graphs": []}, tmp_path / "old.kiln")
    with pytest.raises(persist.LoadError, match="it has no manifest .*format 1.* must be saved again"):
        kiln.load(tmp_path / "old.kiln")


class _Runs:
    """Unpickled, it would create a file: records are read without running anything."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_records_that_would_run_code_are_refused_without_running_it(saved):
    path, _, _ = saved
    marker = path.parent / "ran"
    records = persist.dumps({"forward": ["input"], "graphs": [_Runs(marker)]})
    parts = {**parts_of(path), persist.RUNS: records}
    manifest = json.loads(parts[persist.MANIFEST])
    manifest["parts"][persist.RUNS] = checksum(records)
    rewrite(path, {**parts, persist.MANIFEST: json.dumps(manifest).encode()})
    with pytest.raises(persist.LoadError, match=f"its {persist.RUNS} holds what a compiled model does not"):
        kiln.load(path)
    assert not marker.exists()
