"""Symbolic sizes on CUDA. Without a GPU: the auto-scheduler's programs of tasks with symbolic
sizes have one source for every size of a regime, and compile with NVRTC. With a GPU (`cuda`
marker): their results against PyTorch at odd sizes, and torch.compile(dynamic=True) building
no auto-scheduled kernel again at new sizes, its CUDA graphs captured per size."""
import logging

import pytest
import torch

import kiln
from kiln.graph import trace_from
from kiln.ir import SymSize
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program
from kiln.tensor import symbol

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
SIZES = (7, 33, 130)


def _graph(n: int, device: str = "cpu"):
    """Softmax and sums over a symbolic dim (warp rows, reductions), a layer norm over it, a
    flatten across it, an element-wise chain and a layer norm of a symbolic number of rows (on
    either side of the row kernels' fixed-size threshold), on x: float32[s0, 70] and
    y: float32[192, s0]."""
    s = SymSize.named("s0", n)
    x, y = symbol((s, 70), "float32", device), symbol((192, s), "float32", device)
    outs = [kiln.ops.softmax(x, 0), kiln.ops.sum(x, 0), kiln.ops.softmax(y, -1),
            kiln.ops.layer_norm(kiln.ops.permute(x, (1, 0)), (s,)), kiln.ops.sum(kiln.ops.reshape(x, (-1,)), 0),
            kiln.ops.tanh(x * 2 + 1), kiln.ops.layer_norm(x, (70,))]
    return trace_from(outs, [x, y])


def _expected(x: torch.Tensor, y: torch.Tensor) -> list:
    return [x.softmax(0), x.sum(0), y.softmax(-1), torch.nn.functional.layer_norm(x.T, (x.shape[0],)),
            x.reshape(-1).sum(0), torch.tanh(x * 2 + 1), torch.nn.functional.layer_norm(x, (70,))]


@needs_nvrtc
def test_one_source_per_regime_and_every_source_compiles():
    sources = {n: [auto_program(node.task, "cuda") for node in _graph(n).nodes] for n in SIZES}
    assert [p.source for p in sources[7]] == [p.source for p in sources[33]] == [p.source for p in sources[130]]
    assert all(p.sizes == (33,) for p in sources[33])
    rt.compile_many([(p.source, p.kernel_names[0], arch) for p in sources[33] for arch in ("sm_80", "sm_90")])


@pytest.mark.cuda
@pytest.mark.parametrize("n", SIZES + (1, 3000))
def test_symbolic_programs_match_pytorch_on_the_gpu(n):
    graph = _graph(n, "cuda")
    x, y = torch.randn(n, 70, device="cuda"), torch.randn(192, n, device="cuda")
    for got, want in zip(graph(x, y), _expected(x, y)):
        torch.testing.assert_close(got.torch(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_dynamic_true_builds_no_auto_scheduled_kernel_again(tmp_path, monkeypatch, caplog):
    """Every kernel of this model is the auto-scheduler's: after the first batch size, no build
    at all; each size's CUDA graph replays its own size."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="kiln")
    torch._dynamo.reset()

    def fn(x, w):
        h = torch.nn.functional.layer_norm(x, (x.shape[-1],)) * w
        return torch.softmax(h, -1).sum(0) + torch.tanh(h).mean(-1, keepdim=True).sum()

    compiled = torch.compile(fn, backend="kiln", dynamic=True)
    w = torch.randn(96, device="cuda")
    built = []
    for batch in (5, 33, 130, 5):
        x = torch.randn(batch, 96, device="cuda")
        before = sum(r.getMessage().startswith("kernel cache miss") for r in caplog.records)
        torch.testing.assert_close(compiled(x, w), fn(x, w), atol=1e-4, rtol=1e-4)
        built.append(sum(r.getMessage().startswith("kernel cache miss") for r in caplog.records) - before)
    torch._dynamo.reset()
    assert built[0] > 0 and built[1:] == [0, 0, 0]
