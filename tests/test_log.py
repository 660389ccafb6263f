"""KILN_LOG (the logger `kiln`), KILN_DUMP_DIR (what a compile leaves to look at) and each
compile's summary (in the dump folder and in torch's structured trace)."""
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

# what a compile logs and dumps, not which CUDA programs its tasks make: `make test`'s NVRTC check
# off, here and in the fresh processes (on each test's empty kernel cache it compiled every CUDA
# program of each CPU build again)
pytestmark = pytest.mark.usefixtures("no_nvrtc_check")

SCRIPT = """
import pytest
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2)).eval()
with torch.no_grad():
    x = torch.randn(3, 5)
    torch.testing.assert_close(torch.compile(model, backend="kiln")(x), model(x))
"""


def _run(tmp_path, **env):
    """SCRIPT in a fresh process on an empty kernel cache."""
    environment = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache"), **env}
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=environment, timeout=600)


def test_kiln_log_info_prints_the_stages_and_the_kernels_built(tmp_path):
    proc = _run(tmp_path, KILN_LOG="info")
    assert proc.returncode == 0, proc.stderr
    log = [line for line in proc.stderr.splitlines() if line.startswith("kiln INFO: ")]
    for stage in ("interpret", "optimize", "build"):
        assert any(f"stage {stage}" in line and line.endswith(" ms") for line in log), stage
    assert any("compiling a graph of" in line and "float32[3, 5]" in line for line in log)
    assert any("kernel cache miss: building cpu/" in line for line in log)
    assert not any("kernel cache hit" in line for line in log)    # hits are debug


def test_without_kiln_log_kiln_prints_nothing(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "kiln INFO" not in proc.stderr


def test_kiln_log_debug_shows_cache_hits(tmp_path):
    assert _run(tmp_path).returncode == 0           # fills the cache
    proc = _run(tmp_path, KILN_LOG="debug")
    assert proc.returncode == 0, proc.stderr
    assert "kiln DEBUG: kernel cache hit: cpu/" in proc.stderr
    assert "kernel cache miss" not in proc.stderr


def test_kiln_dump_dir_keeps_graphs_sources_and_the_memory_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    _compile_small_model()
    folders = sorted(tmp_path.glob("graph-*"))
    assert len(folders) == 1
    folder = folders[0]
    assert "torch._C._nn.linear" in (folder / "fx_graph.py").read_text()
    stages = sorted(p.name for p in (folder / "passes").iterdir())
    assert stages[0] == "00_input.txt" and any("fuse" in s for s in stages)
    assert "Fused" in (folder / "flow_graph.txt").read_text()
    sources = sorted((folder / "kernels").glob("*.c"))
    assert sources and all("kiln_kernel" in s.read_text() for s in sources)
    plan = (folder / "memory_plan.txt").read_text()
    assert plan.startswith("CompiledGraph(") and "workspace on cpu" in plan and "offset" in plan


def _compile_small_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2), nn.Softmax(-1)).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        x = torch.randn(3, 5)
        torch.testing.assert_close(torch.compile(model, backend="kiln")(x), model(x))


def test_kiln_dump_dir_keeps_a_json_summary_line_per_compile(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="kiln")
    _compile_small_model()
    _compile_small_model()
    first, second = [json.loads(line) for line in
                     (tmp_path / "dump" / "compile_summary.jsonl").read_text().splitlines()]
    assert re.fullmatch(r"\d+/\d+", first["compile_id"])
    assert (tmp_path / "dump" / first["dump"] / "fx_graph.py").exists()
    assert first["inputs"][2] == "float32[3, 5]" and first["nodes_mapped"] == 4
    assert first["left_to_pytorch"] == [] and first["operators"] == 4 and first["kernels"] >= 1
    # the first compile builds its CPU kernels (or takes those an earlier test of this process
    # built), once for each distinct task; the second takes them all from this process
    lookups = sum(first["kernel_cache"].get("cpu", {}).values())
    assert 1 <= lookups + first["kernels_reused"] <= first["kernels"]
    assert "cpu" not in second["kernel_cache"] and 1 <= second["kernels_reused"] <= second["kernels"]
    assert first["tuning"] == {"templates": [], "results_reused": 0}
    # the stages are the log's own measures, not measured again
    logged = [float(m) for m in re.findall(r"stage build \(\d+ kernels\): ([\d.]+) ms", caplog.text)]
    assert logged == [round(s["stages_ms"]["build"], 1) for s in (first, second)]
    assert set(first["stages_ms"]) == {"interpret", "optimize", "build"}


def test_kiln_dump_dir_summary_lists_what_runs_in_pytorch(tmp_path, monkeypatch, fresh_dynamo):
    import kiln

    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    kiln.torch.dynamo_config.fallback_to_eager(True)
    x = torch.randn(4)
    with pytest.warns(UserWarning, match="Kiln runs these nodes in PyTorch"):
        torch.testing.assert_close(torch.compile(lambda x: torch.special.i0(x.relu()) + 1,
                                                 backend="kiln")(x), torch.special.i0(x.relu()) + 1)
    summaries = [json.loads(line) for line in (tmp_path / "compile_summary.jsonl").read_text().splitlines()]
    assert len(summaries) == 2, "one line for each part Kiln compiles"
    assert all([(n["node"], n["operator"]) for n in s["left_to_pytorch"]] == [("special_i0", "torch.special.i0")]
               and "no Kiln rule maps" in s["left_to_pytorch"][0]["reason"] for s in summaries)


def test_torch_trace_captures_the_summary(tmp_path):
    proc = _run(tmp_path, TORCH_TRACE=str(tmp_path / "trace"))
    assert proc.returncode == 0, proc.stderr
    lines = "".join(p.read_text() for p in (tmp_path / "trace").iterdir()).splitlines()
    found = [k for k, line in enumerate(lines) if '"name": "kiln_compile_summary"' in line]
    assert len(found) == 1, "one compile, one summary"
    metadata = json.loads(lines[found[0]].split("] ", 1)[1])
    assert metadata["artifact"]["encoding"] == "json" and metadata["frame_id"] == 0
    summary = json.loads(lines[found[0] + 1].removeprefix("\t"))
    assert summary["compile_id"] == "0/0" and summary["kernels"] >= 1 and "build" in summary["stages_ms"]


def test_kiln_dump_dir_skips_view_steps(tmp_path, monkeypatch):
    """A graph with a reshape that runs as a view (no kernel) is dumped too: its kernels' sources,
    none for the view (the dump raised on a view step)."""
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    torch._dynamo.reset()
    x = torch.randn(4, 6)
    f = torch.compile(lambda x: (x.exp().reshape(2, 12) * 2).sum(-1), backend="kiln")
    torch.testing.assert_close(f(x), (x.exp().reshape(2, 12) * 2).sum(-1))
    (folder,) = sorted(tmp_path.glob("graph-*"))
    assert (folder / "memory_plan.txt").exists()
    assert sorted((folder / "kernels").glob("*.c"))
