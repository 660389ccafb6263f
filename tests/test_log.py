"""KILN_LOG (the logger `kiln`) and KILN_DUMP_DIR (what a compile leaves to look at)."""
import os
import subprocess
import sys

import torch
from torch import nn

SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2)).eval()
with torch.no_grad():
    x = torch.randn(3, 5)
    torch.testing.assert_close(torch.compile(model, backend="kiln")(x), model(x))
"""


def _run(tmp_path, **env):
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
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2), nn.Softmax(-1)).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        x = torch.randn(3, 5)
        torch.testing.assert_close(torch.compile(model, backend="kiln")(x), model(x))
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
