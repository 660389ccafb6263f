"""benchmarks/kernel_counts.py: the launches it counts are the graph's whether its kernels were
built in this process or loaded from the graph cache."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from kernel_counts import counting_launches  # noqa: E402  (benchmarks/ is no package)

from kiln.frontend.torch import registry as mapping_rules  # noqa: E402


def test_launches_of_a_graph_loaded_from_the_cache_are_counted(tmp_path, monkeypatch):
    """`tree_ab.py` reported 0 kernels a forward in a second process: it counted calls of
    `CompiledTask`, and a graph loaded from the graph cache calls its kernels as `DeviceKernel`s."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_GRAPH_CACHE", "1")
    monkeypatch.setattr(mapping_rules, "_declared", [])     # other modules' rules turn the cache off
    monkeypatch.setattr(mapping_rules, "_live", None)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
    x = torch.randn(4, 32)
    counts = []
    with torch.no_grad():
        for _ in range(2):          # built, then loaded from the graph cache
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="kiln")
            compiled(x)
            with counting_launches() as launches:
                compiled(x)
            counts.append(launches[0])
    assert counts[0] > 0 and counts == [counts[0]] * 2, counts
