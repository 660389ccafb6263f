"""kiln.save / kiln.load: a compiled model restored in a fresh process builds no kernel."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import kiln
from kiln.frontend.torch.persist import SaveError

SAVE = """
import sys, torch, kiln
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 5, 6),
                      nn.LayerNorm(6)).eval()
compiled = torch.compile(model, backend="kiln")
x, y = torch.randn(2, 3, 6, 7), torch.randn(5, 3, 6, 7)
with torch.no_grad():
    outs = [compiled(x), compiled(y)]
kiln.save(compiled, sys.argv[1])
torch.save({"inputs": [x, y], "expected": [model(x).detach(), model(y).detach()]}, sys.argv[2])
"""

LOAD = """
import sys, torch, kiln
import kiln.runtime.cpu
def no_build(*args, **kwargs):
    raise AssertionError("kiln.load built a kernel")
kiln.runtime.cpu.build_shared_library = no_build
loaded = kiln.load(sys.argv[1])
io = torch.load(sys.argv[2])
for x, expected in zip(io["inputs"], io["expected"]):
    torch.testing.assert_close(loaded(x), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loaded(input=x), expected, atol=1e-4, rtol=1e-4)
print("loaded ok")
"""


def _python(script, *args, cache, **env):
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "KILN_CACHE_DIR": str(cache), **env})


def test_a_saved_model_runs_in_a_fresh_process_with_zero_kernel_builds(tmp_path):
    model, io = tmp_path / "model.kiln", tmp_path / "io.pt"
    saved = _python(SAVE, model, io, cache=tmp_path / "cache-save")
    assert saved.returncode == 0, saved.stderr
    loaded = _python(LOAD, model, io, cache=tmp_path / "cache-load", KILN_LOG="info")
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded ok" in loaded.stdout
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


def test_a_loaded_model_refuses_inputs_it_was_not_compiled_for(compiled, tmp_path):
    eager, model = compiled
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)
    kiln.save(model, tmp_path / "m.kiln")
    loaded = kiln.load(tmp_path / "m.kiln")
    torch.testing.assert_close(loaded(x), eager(x).detach())
    with pytest.raises(ValueError, match=r"compiled for inputs float32\[2, 4\], not float32\[3, 4\]"):
        loaded(torch.randn(3, 4))


def test_load_refuses_other_files(tmp_path):
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a compiled model saved by kiln.save"):
        kiln.load(tmp_path / "other.pt")
