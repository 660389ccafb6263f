"""benchmarks/plot.py: which records and cases it draws (the drawing itself needs matplotlib,
which Kiln does not depend on: that test skips without it)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import plot  # noqa: E402  (benchmarks/ is no package)

NOW = time.time()


def model_row(model, eager, inductor_cg, kiln, dtype="float16"):
    return {"model": model, "dtype": dtype, "eager_ms": eager, "inductor_ms": eager,
            "inductor_cg_ms": inductor_cg, "kiln_ms": kiln}


def rounded(cases: dict) -> dict:
    return {label: {b: round(v, 6) for b, v in speedups.items()} for label, speedups in cases.items()}


def write(folder: Path, name: str, data, age_days: float) -> None:
    path = folder / name
    path.write_text(json.dumps(data))
    os.utime(path, (NOW - age_days * plot.DAY,) * 2)


@pytest.fixture
def results(tmp_path):
    """A results folder outside git: records are as old as their modification times."""
    write(tmp_path, "h200_models_2026-11-20.json", [model_row("gpt2", 9.0, 1.0, 1.0)], 6)
    write(tmp_path, "h200_models_2026-11-25.json",
          [model_row("resnet50", 8.0, 2.0, 4.0), model_row("bert", 6.0, 2.0, 2.0)], 1)
    write(tmp_path, "h200_models_2026-11-26.json",
          [model_row("resnet50", 8.0, 2.0, 1.0), {"model": "vit", "dtype": "float16", "error": "boom"}], 0)
    write(tmp_path, "h200_models_ab_2026-11-26.json", [model_row("bert", 60.0, 20.0, 1.0)], 0)
    write(tmp_path, "h100_models_2026-11-26.json", [model_row("bert", 5.0, 1.0, 1.0)], 0)
    write(tmp_path, "h200_decode.json", {"gpu": "NVIDIA H200", "rows": [
        {"model": "llama", "batch": 1, "backend": b, "ms_per_token": ms}
        for b, ms in (("eager", 8.0), ("inductor_cg", 0.6), ("kiln", 0.5))]}, 0)
    write(tmp_path, "gemm.json", {"gpu": "NVIDIA H200", "rows": [
        {"group": "square", "name": n, "dtype": "float16", "template": "gemm_sm90",
         "kiln_us": 1.0, "torch_us": us} for n, us in (("a", 2.0), ("b", 0.5), ("c", 1.0))]}, 0)
    write(tmp_path, "h200_kernel_times.json", [{"model": "bert", "dtype": "float16", "steps": 3}], 0)
    return tmp_path


def test_each_case_comes_from_the_newest_record_of_one_gpu(results):
    found = plot.records(results, plot.EXCLUDE)
    assert "h200_models_ab_2026-11-26.json" not in [r.path.name for r in found], "A/B runs left out"
    assert {r.gpu for r in found} == {"H200", "H100"}
    h200 = [r for r in found if r.gpu == "H200"]
    inference, decode, training, gemm, attention = (plot.newest_cases(w, h200, days=2) for w in plot.WORKLOADS)
    cases, files = inference
    assert rounded(cases) == {"resnet50 float16": {"eager": 8.0, "Inductor + CUDA graphs": 2.0},
                     "bert float16": {"eager": 3.0, "Inductor + CUDA graphs": 1.0}}, \
        "resnet50 from the newest record, bert from the one before, gpt2 too old, vit failed"
    assert files == {"h200_models_2026-11-25.json", "h200_models_2026-11-26.json"}
    assert rounded(decode[0]) == {"llama b1": {"eager": 16.0, "Inductor + CUDA graphs": 1.2}}
    assert rounded(gemm[0]) == {"GEMM square (3)": {"cuBLAS": 1.0}}, "geometric mean of 2, 0.5, 1"
    assert training == ({}, set()) and attention == ({}, set())


def test_the_picture_is_written(results, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    out = tmp_path / "speedup.png"
    monkeypatch.setattr("sys.argv", ["plot.py", "--results", str(results), "--out", str(out)])
    plot.main()
    assert out.read_bytes().startswith(b"\x89PNG")
