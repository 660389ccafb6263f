"""sort, argsort, topk, kthvalue, median and nanmedian on a CUDA GPU (the `sort_bitonic`
template) against PyTorch: odd row lengths (many rows to a CTA, a row to a CTA, rows sorted in
chunks and merged in global memory), many ties, NaN, infinities and signed zeros, both orders,
dims other than the last, non-contiguous inputs, every dtype.

The reference order is PyTorch's stable sort (NaN above every number, first when descending),
which the operators define: topk takes its first k, kthvalue its rank k - 1, median rank
(n - 1) // 2 or a row's first NaN, nanmedian the lower median of the numbers. Values are also
compared with PyTorch's own topk, kthvalue, median and nanmedian."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from kiln_ops_builtin.templates import sort_bitonic
from tests.support import assert_close

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]
LENGTHS = [1, 7, 1000, 4097, 20000]


def _values(shape, dtype):
    """Fresh random values with many ties; floats also hold NaN, infinities and -0.0."""
    if dtype == torch.bool:
        return (torch.rand(shape) < 0.5).to(DEVICE)
    low = 0 if dtype == torch.uint8 else -40
    x = torch.randint(low, 41, shape).to(torch.float64)
    if dtype.is_floating_point:
        x = x / 8
        u = torch.rand(shape)
        x[u < 0.05] = float("nan")
        x[(u >= 0.05) & (u < 0.07)] = float("inf")
        x[(u >= 0.07) & (u < 0.09)] = -float("inf")
        x[(u >= 0.09) & (u < 0.12)] = -0.0
    return x.to(dtype).to(DEVICE)


def _same(actual, expected):
    assert_close(actual, expected.to(DEVICE), atol=0, rtol=0)


def _stable(x, dim, descending=False):
    return torch.sort(x.cpu(), dim=dim, descending=descending, stable=True)


def _ranked(x, dim, rank):
    """(values, indices) of the stable ascending order's element of `rank` (a tensor of x's
    shape with `dim` of size 1) along `dim`."""
    ordered = _stable(x, dim)
    return ordered.values.gather(dim, rank).squeeze(dim), ordered.indices.gather(dim, rank).squeeze(dim)


def _numbers(x, dim):
    """How many elements of each row are not NaN, keeping dim."""
    x = x.cpu()
    if x.dtype.is_floating_point:
        return (~x.isnan()).sum(dim, keepdim=True)
    return torch.full([1 if k == dim else s for k, s in enumerate(x.shape)], x.shape[dim])


def test_the_template_sorts_on_the_gpu():
    from kiln.runtime.cuda import arch_number, device_info
    from kiln.schedule import schedules_for
    definition = registry().operator("topk")
    task = definition.task(definition.bind([kiln.from_torch(_values((64, 32000), torch.float32)), 50], {}))[0]
    assert schedules_for(task, "cuda", arch_number(device_info(0)["arch"]))[0].name == "sort_bitonic"


@pytest.mark.parametrize("knobs", sort_bitonic.TEMPLATE.space(1), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_knob_setting(dtype, knobs):
    """Each tuning candidate: the default tile, 256 and 1024 threads, 2048-item chunks merged."""
    from kiln.runtime.backend import backend_for
    x = _values((3, 5000), dtype)
    definition = registry().operator("sort")
    task = definition.task(definition.bind([kiln.from_torch(x), 1, True], {}))[0]
    runner = backend_for(kiln.device(DEVICE)).load(sort_bitonic.render(task, **knobs), kiln.device(DEVICE))
    values, indices = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int64, device=DEVICE)
    runner([x], [values, indices])
    expected = _stable(x, 1, True)
    _same(values, expected.values)
    _same(indices, expected.indices)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_every_dtype(dtype, n):
    x = _values((3, n), dtype)
    for descending in (False, True):
        expected = _stable(x, 1, descending)
        values, indices = kiln.ops.sort(x, 1, descending)
        _same(values, expected.values)
        _same(indices, expected.indices)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("layout", ["middle_dim", "transposed"])
def test_sort_other_dims_and_noncontiguous(layout, n):
    if layout == "middle_dim":
        x, dim = _values((2, n, 3), torch.float32), 1
    else:
        x, dim = _values((n, 5), torch.float16).t(), 1         # (5, n), not contiguous
    for descending in (False, True):
        expected = _stable(x, dim, descending)
        _same(kiln.ops.argsort(x, dim, descending), expected.indices)
        values, indices = kiln.ops.sort(x, dim, descending)
        _same(values, expected.values)
        _same(indices, expected.indices)
    ordered = _stable(x, 0)
    _same(kiln.ops.sort(x, 0)[1], ordered.indices)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8])
def test_topk(dtype, n):
    x = _values((4, n), dtype) if dtype != torch.float32 else _values((n, 4), dtype).t()
    k = min(n, 50)
    for largest in (True, False):
        values, indices = kiln.ops.topk(x, k, 1, largest)
        expected = _stable(x, 1, largest)
        _same(values, expected.values[:, :k])
        _same(indices, expected.indices[:, :k])
        _same(values, torch.topk(x.cpu(), k, 1, largest).values)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
def test_kthvalue_median_nanmedian(dtype, n):
    x = _values((5, n, 2), dtype)
    dim = 1
    numbers = _numbers(x, dim)
    k = n // 3 + 1
    cases = {
        "kthvalue": (kiln.ops.kthvalue(x, k, dim), torch.full_like(numbers, k - 1), torch.kthvalue(x.cpu(), k, dim)),
        "median": (kiln.ops.median(x, dim), torch.where(numbers < n, numbers, (n - 1) // 2), torch.median(x.cpu(), dim)),
        "nanmedian": (kiln.ops.nanmedian(x, dim), (numbers - 1).clamp(min=0) // 2, torch.nanmedian(x.cpu(), dim)),
    }
    for (values, indices), rank, torch_result in cases.values():
        expected_values, expected_indices = _ranked(x, dim, rank)
        _same(values, expected_values)
        _same(indices, expected_indices)
        _same(values, torch_result.values)
    values, indices = kiln.ops.median(x, dim, True)
    assert tuple(values.shape) == tuple(indices.shape) == (5, 1, 2)


def test_compiled_topk_of_logits():
    """Top-k sampling's step through torch.compile: (64, 32000) logits."""
    logits = torch.randn(64, 32000, device=DEVICE)
    logits[:, ::7] = logits[:, :1]                                   # ties with the first column
    compiled = torch.compile(lambda t: torch.topk(t, 50), backend="kiln")
    values, indices = compiled(logits)
    expected = _stable(logits, 1, True)
    _same(values, expected.values[:, :50])
    _same(indices, expected.indices[:, :50])
