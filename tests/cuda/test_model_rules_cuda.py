"""The rules real models needed (the CPU tests in tests/frontend/test_model_operators.py,
test_aten_lowering.py and tests/training/test_aten_rules.py) on a CUDA GPU against eager there:
baddbmm by argument name, a masked write through a view (ATen's index_put with one bool mask),
graphs lowered through AOTAutograd (numpy, vmap), transformers' grouped-matmul backward, and a
depthwise convolution's weight gradient as one grouped convolution. Float32 (TF32 off) and
16-bit types."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.frontend.test_aten_lowering import batched_dot, scores

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

DEVICE = "cuda"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _close(got, want, dtype):
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def _forward(fn, *inputs):
    with torch.no_grad():
        return torch.compile(fn, backend="kiln", fullgraph=True)(*inputs), fn(*inputs)


@pytest.mark.parametrize("dtype", TOL)
def test_baddbmm_arguments_by_name(dtype):
    alibi, q, k = (torch.randn(s, device=DEVICE, dtype=dtype) for s in [(6, 1, 9), (6, 5, 7), (6, 9, 7)])
    _close(*_forward(lambda a, q, k: a.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=0.25),
                     alibi, q, k), dtype)


def _masked_column(x, m):
    y = x * 1
    y[:, 0][m] = -10000.0
    return y


def _masked_column_added(x, m):
    y = x * 1
    y[:, 1].index_put_((m,), torch.tensor(2.5, device=x.device, dtype=x.dtype), accumulate=True)
    return y


@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("fn", [_masked_column, _masked_column_added], ids=["put", "accumulate"])
@pytest.mark.parametrize("shape", [(4, 6, 5), (3, 2, 130)], ids=str)
def test_one_mask_and_one_value_written_through_a_view(fn, shape, dtype):
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    got, want = _forward(fn, x, x[:, 0, :2].sum(-1) > 0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("fn, shapes", [(scores, [(2, 3, 5, 8), (2, 3, 7, 8)]),
                                        (batched_dot, [(4, 6, 9), (4, 6, 9)])], ids=["numpy", "vmap"])
def test_graphs_lowered_through_aotautograd(fn, shapes):
    inputs = [torch.randn(s, device=DEVICE) for s in shapes]
    with torch.no_grad():
        got = torch.compile(fn, backend="kiln")(*inputs)
    _close(got, fn(*inputs), torch.float32)


def test_numpy_random_numbers_on_the_gpu():
    def draw(x):
        return x + torch.from_numpy(np.random.uniform(2.0, 3.0, size=x.shape[0])).to(x.device, x.dtype)

    fn, x = torch.compile(draw, backend="kiln"), torch.zeros(4000, device=DEVICE)
    torch.manual_seed(0)
    first, second = fn(x), fn(x)
    torch.manual_seed(0)
    assert torch.equal(fn(x), first) and not torch.equal(first, second)
    assert 2.0 <= first.min() and first.max() < 3.0 and abs(first.mean().item() - 2.5) < 0.02


def _gradients(fn, inputs, weights):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * weights).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_grouped_mm_fallback_backward(dtype):
    pytest.importorskip("transformers.integrations.moe")
    if not hasattr(torch.ops.transformers, "grouped_mm_fallback_backward"):
        pytest.skip("this transformers' grouped_mm_fallback has a Python backward that reads its offsets "
                    "(offs.tolist()): no compiler traces it (Inductor fails alike)")
    fallback = torch.ops.transformers.grouped_mm_fallback
    ends = torch.tensor([4, 4, 9, 11], device=DEVICE)
    x, w = torch.randn(12, 5, device=DEVICE, dtype=dtype), torch.randn(4, 5, 7, device=DEVICE, dtype=dtype)
    weights = torch.linspace(-1, 2, 7, device=DEVICE, dtype=dtype)
    compiled = torch.compile(lambda a, b: fallback(a, b, ends), backend="kiln", fullgraph=True)
    got = _gradients(compiled, (x, w), weights)
    want = _gradients(lambda a, b: fallback(a, b, ends), (x, w), weights)
    for g, e in zip(got, want):
        _close(g, e, dtype)
    assert torch.equal(got[1][11:], torch.zeros(1, 5, device=DEVICE, dtype=dtype))
    assert torch.equal(got[2][1], torch.zeros(5, 7, device=DEVICE, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("multiplier", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_depthwise_conv2d_weight_gradient(multiplier, channels_last, dtype):
    torch.manual_seed(0)
    c = 48
    x = torch.randn(2, c, 9, 11, device=DEVICE, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.randn(c * multiplier, 1, 3, 3, device=DEVICE, dtype=dtype)
    b = torch.randn(c * multiplier, device=DEVICE, dtype=dtype)
    weights = torch.randn(2, c * multiplier, 5, 6, device=DEVICE, dtype=dtype)
    fn = lambda x, w, b: F.conv2d(x, w, b, 2, 1, 1, c)  # noqa: E731
    got = _gradients(torch.compile(fn, backend="kiln"), (x, w, b), weights)
    want = _gradients(fn, (x, w, b), weights)
    for g, e in zip(got, want):
        scale = e.abs().max().item()
        torch.testing.assert_close(g, e, atol=TOL[dtype] * scale, rtol=TOL[dtype])
