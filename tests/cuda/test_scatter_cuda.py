"""scatter_add, scatter_reduce, index_add, index_put with accumulate and index_reduce on a CUDA
GPU (the `scatter_atomic` template) against PyTorch: hot spots (thousands of sources on a few
targets), every reduction with and without x's own value, dims other than 0, negative
indices, non-contiguous inputs, every dtype the template takes, and an embedding's gradient
through torch.compile. Float references are computed in float64 on the CPU; the order in
which atomics add is not fixed, so sums compare within a tolerance scaled to their size."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from tests.support import FLOAT_TOL, assert_close

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
REDUCTIONS = ["sum", "prod", "mean", "amax", "amin"]


def _values(shape, dtype, how="sum"):
    """Fresh random values; near 1 for products (thousands of factors stay finite)."""
    if how == "prod":
        x = 1 + torch.randn(shape, dtype=torch.float64) / 100 if dtype.is_floating_point else \
            torch.where(torch.rand(shape) < 0.01, 2, 1) * torch.where(torch.rand(shape) < 0.01, -1, 1)
    else:
        x = torch.randn(shape, dtype=torch.float64) * 2 if dtype.is_floating_point else torch.randint(-50, 51, shape)
    return x.to(dtype)


def _hot(high, shape):
    """Indices in [-high, high) of which most hit 0, 1 or -1 (the last)."""
    index = torch.randint(-high, high, shape)
    return torch.where(torch.rand(shape) < 0.8, torch.randint(-1, 2, shape), index)


def _check(actual, reference, dtype, how):
    """`actual` (Kiln, on the GPU) against `reference` computed on the CPU from float64 inputs for
    float dtypes (exact ones for integers)."""
    if not dtype.is_floating_point:
        assert_close(actual, reference.to(DEVICE))
        return
    tol = FLOAT_TOL[dtype][0] if dtype in (torch.float16, torch.bfloat16) else 1e-12 if how in ("amax", "amin") else 1e-5
    scale = reference.abs().nan_to_num(posinf=0, neginf=0).max().item() or 1.0
    assert_close(actual, reference.to(dtype).to(DEVICE), atol=tol * scale, rtol=tol)


def _on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _exact(*tensors):
    return [t.double() if t.dtype.is_floating_point else t for t in tensors]


def test_the_template_scatters_on_the_gpu():
    from kiln.runtime.cuda import arch_number, device_info
    from kiln.schedule import schedules_for
    definition = registry().operator("index_add")
    args = [kiln.from_torch(t) for t in _on_device(torch.randn(100, 8), torch.randint(0, 100, (50,)), torch.randn(50, 8))]
    task = definition.task(definition.bind([args[0], 0, args[1], args[2]], {}))[0]
    assert schedules_for(task, "cuda", arch_number(device_info(0)["arch"]))[0].name == "scatter_atomic"


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_add_hot_spots_along_both_dims(dtype):
    x, src = _values((7, 300), dtype), _values((4000, 300), dtype)
    index = _hot(7, (4000, 300)) % 7
    a, i, s = _on_device(x, index, src)
    xd, sd = _exact(x, src)
    _check(kiln.ops.scatter_add(a, 0, i, s), xd.scatter_add(0, index, sd), dtype, "sum")
    # along dim 1 of non-contiguous views, the index smaller than src
    xt, st, it = x.t(), _values((300, 5000), dtype), index.t()[:, :3000] % 7
    a, i, s = _on_device(xt, it, st)
    assert not a.is_contiguous()
    xd, sd = _exact(xt, st)
    _check(kiln.ops.scatter_add(a, 1, i, s), xd.scatter_add(1, it, sd), dtype, "sum")


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("how", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_reduce(dtype, how, include_self):
    x, src = _values((9, 33), dtype, how), _values((3001, 33), dtype, how)
    index = _hot(9, (3001, 33)) % 9
    index[:, -1] = 4                               # one column's elements other than 4 keep x's own value
    a, i, s = _on_device(x, index, src)
    xd, sd = _exact(x, src)
    expected = xd.scatter_reduce(0, index, sd, how, include_self=include_self)
    _check(kiln.ops.scatter_reduce(a, 0, i, s, how, include_self), expected, dtype, how)


@pytest.mark.parametrize("how", ["amax", "amin"])
def test_scatter_reduce_propagates_nan(how):
    x, src = torch.randn(5, 6), torch.randn(200, 6)
    src[17, 2] = float("nan")
    x[3, 4] = float("nan")
    index = torch.randint(0, 5, (200, 6))
    a, i, s = _on_device(x, index, src)
    assert_close(kiln.ops.scatter_reduce(a, 0, i, s, how), x.scatter_reduce(0, index, src, how).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_add_embedding_gradient_shape(dtype):
    """index_add of many token rows into a vocabulary-shaped table: frequent tokens are hot spots;
    negative indices count from the end."""
    x, source = _values((1000, 64), dtype), _values((6000, 64), dtype)
    index = _hot(1000, (6000,))
    alpha = 1 if not dtype.is_floating_point else 0.5
    a, i, s = _on_device(x, index, source)
    xd, sd = _exact(x, source)
    _check(kiln.ops.index_add(a, 0, i, s, alpha), xd.index_add(0, index % 1000, sd, alpha=alpha), dtype, "sum")
    x3, s3 = _values((4, 50, 3), dtype), _values((4, 700, 3), dtype).transpose(0, 1).contiguous().transpose(0, 1)
    index = _hot(50, (700,))
    a, i, s = _on_device(x3, index, s3)
    xd, sd = _exact(x3, s3)
    _check(kiln.ops.index_add(a, 1, i, s), xd.index_add(1, index % 50, sd), dtype, "sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_put_accumulate(dtype):
    x = _values((40, 6, 5), dtype)
    rows, cols = _hot(40, (500, 1)), _hot(6, (1, 3))             # broadcast to (500, 3)
    values = _values((500, 3, 5), dtype)
    a, r, c, v = _on_device(x, rows, cols, values)
    xd, vd = _exact(x, values)
    _check(kiln.ops.index_put(a, [r, c], v, True), xd.index_put((rows, cols), vd, accumulate=True), dtype, "sum")
    one = _values((5,), dtype)                                   # one value row broadcast to every index
    a, r, o = _on_device(x, rows[:, 0], one)
    xd, od = _exact(x, one)
    _check(kiln.ops.index_put(a, [r], o, True), xd.index_put((rows[:, 0],), od, accumulate=True), dtype, "sum")


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("how", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_index_reduce(dtype, how, include_self):
    x, source = _values((6, 40), dtype, how), _values((6, 2000), dtype, how)
    index = _hot(40, (2000,)) % 40
    a, i, s = _on_device(x, index, source)
    xd, sd = _exact(x, source)
    expected = xd.index_reduce(1, index, sd, how, include_self=include_self)
    _check(kiln.ops.index_reduce(a, 1, i, s, how, include_self), expected, dtype, how)


def test_compiled_embedding_gradient():
    """An embedding trained through torch.compile: its gradient is embedding_backward's (the
    embedding_grad template; tests/cuda/test_embedding_grad_cuda.py tests it further)."""
    embedding = torch.nn.Embedding(500, 32).to(DEVICE)
    ids = (_hot(500, (16, 128)) % 500).to(DEVICE)
    compiled = torch.compile(lambda t: embedding(t).square().sum(), backend="kiln")
    compiled(ids).backward()
    grad, embedding.weight.grad = embedding.weight.grad, None
    embedding(ids).square().sum().backward()
    assert_close(grad, embedding.weight.grad, atol=1e-4, rtol=1e-5)
