"""Operators real models use that Kiln used to lack or decline (issue 30), through
torch.compile(backend="kiln") (and symbolic_trace graphs where dynamo rewrites the call) on the
CPU against eager: Tensor.new_tensor, baddbmm and addmm with a broadcast input and alpha/beta,
batch_norm with batch statistics, F.fold (col2im), x[rows, cols] = v with index tensors, histc (also
as `aten.histc` in a functionalized graph), the grouped matmul of mixture-of-experts layers
(`torch._grouped_mm` and transformers' fallback operator)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from frontend_support import compile_and_compare, run_traced

import kiln
from tests.support import assert_close, rand

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


class NewTensor(nn.Module):
    def __init__(self, data, **kwargs):
        super().__init__()
        self.data, self.kwargs = data, kwargs

    def forward(self, x):
        return x.new_tensor(self.data, **self.kwargs) * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("data", [[1.5, -2.25, 3.0], 7, [[1, 2, 3], [4, 5, 6]], [True, False, True], 0.1], ids=str)
def test_new_tensor_takes_self_dtype_and_device(data, dtype):
    """symbolic_trace keeps Tensor.new_tensor as a method call (dynamo rewrites it to torch.tensor)."""
    x = torch.randn(2, 3).to(dtype)
    traced = run_traced(NewTensor(data), x, atol=0, rtol=0)
    assert "new_tensor" in {n.target for n in traced.graph.nodes}


@pytest.mark.parametrize("kwargs", [dict(dtype=torch.float64), dict(dtype=torch.int32), dict(device="cpu"),
                                    dict(dtype=torch.bool)], ids=str)
def test_new_tensor_with_dtype_or_device(kwargs):
    run_traced(NewTensor([[0.5, -1.0], [2.0, 3.5]], **kwargs), torch.randn(5, 2)[::2], atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_new_tensor_from_a_tensor_copies_it():
    class FromTensor(nn.Module):
        def forward(self, x, y):
            return x.new_tensor(y) + x

    run_traced(FromTensor(), torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 3).t())


def test_new_tensor_through_dynamo():
    compile_and_compare(lambda x: x + x.new_tensor([1.0, 2.0, 3.0]), torch.randn(4, 3))
    compile_and_compare(lambda x: x * x.new_tensor(x.shape[0]), torch.randn(5, 3).t())


CREATIONS = {
    "ones(2, 3)": lambda x: torch.ones(2, 3),
    "ones((2, 3))": lambda x: torch.ones((2, 3)),
    "ones(size=)": lambda x: torch.ones(size=(2, 3), dtype=torch.float32),
    "zeros(size=[])": lambda x: torch.zeros(size=[2, 3]) + 0.5,
    "full(size=, fill_value=)": lambda x: torch.full(size=(2, 3), fill_value=0.5),
    "new_ones(2, 3)": lambda x: x.new_ones(2, 3),
    "new_ones((2, 3))": lambda x: x.new_ones((2, 3)),
    "new_ones(size=)": lambda x: x.new_ones(size=(2, 3)),
    "new_zeros(size=)": lambda x: x.new_zeros(size=(2, 3)) - 1,
    "new_full((2, 3), v)": lambda x: x.new_full((2, 3), 0.25),
    "new_full((2, 3), fill_value=)": lambda x: x.new_full((2, 3), fill_value=0.25),
    "new_full(size=, fill_value=)": lambda x: x.new_full(size=(2, 3), fill_value=2.0),
}


@pytest.mark.parametrize("make", list(CREATIONS.values()), ids=list(CREATIONS))
def test_creation_takes_sizes_by_position_or_by_name(make):
    """Before: `torch.ones(size=(2, 17, 1), ...)` (CANINE's) failed to map: the rules took the
    sizes as positional arguments only."""
    compile_and_compare(lambda x: x * make(x) + make(x), torch.randn(2, 3))


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float64: 1e-7, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("input_shape", [(1, 1, 9), (3, 1, 9), (9,), (1, 9), (3, 5, 9), (3, 5, 1)], ids=str)
@pytest.mark.parametrize("beta, alpha", [(1.0, 0.125), (0.5, 1), (2, 0.3), (0.0, 0.7)], ids=str)
def test_baddbmm_broadcast_input(input_shape, beta, alpha, dtype):
    """BLOOM's alibi: torch.baddbmm(alibi, q, k, beta=beta, alpha=inv_norm_factor), alibi of shape
    (batch * heads, 1, n); k transposed (not contiguous); beta 0 ignores a NaN input, as eager does."""
    alibi = torch.randn(input_shape).to(dtype)
    if beta == 0:
        alibi[..., 0] = float("nan")
    q, k = torch.randn(3, 5, 7).to(dtype), torch.randn(3, 9, 7).to(dtype)
    compile_and_compare(lambda a, q, k: torch.baddbmm(a, q, k.transpose(1, 2), beta=beta, alpha=alpha),
                        alibi, q, k, atol=TOL[dtype], rtol=TOL[dtype])
    compile_and_compare(lambda a, q, k: a.baddbmm(q, k.transpose(1, 2), beta=beta, alpha=alpha),
                        alibi, q, k, atol=TOL[dtype], rtol=TOL[dtype])


def test_baddbmm_arguments_by_name():
    """Before: BLOOM's `alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=...)` failed to map
    (Kiln's rule took addmm's names, mat1 and mat2)."""
    alibi, q, k = torch.randn(6, 1, 9), torch.randn(6, 5, 7), torch.randn(6, 9, 7)
    compile_and_compare(lambda a, q, k: a.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=0.25),
                        alibi, q, k, atol=1e-5, rtol=1e-5)
    compile_and_compare(lambda a, q, k: torch.baddbmm(input=a, batch1=q, batch2=k.transpose(1, 2), alpha=0.5),
                        alibi, q, k, atol=1e-5, rtol=1e-5)
    compile_and_compare(lambda a, x, y: torch.addmm(input=a, mat1=x, mat2=y, beta=0.5), torch.randn(4, 6),
                        torch.randn(4, 3), torch.randn(3, 6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("input_shape", [(1, 6), (6,), (4, 6), (4, 1)], ids=str)
@pytest.mark.parametrize("beta, alpha", [(1, 1), (0.25, 3), (0, 0.5)], ids=str)
def test_addmm_broadcast_input(input_shape, beta, alpha):
    bias = torch.randn(input_shape)
    if beta == 0:
        bias[..., 0] = float("inf")
    compile_and_compare(lambda b, x, w: torch.addmm(b, x, w.t(), beta=beta, alpha=alpha),
                        bias, torch.randn(4, 11), torch.randn(6, 11))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 7, 3, 5), (1, 6, 9), (5, 3), (2, 3, 2, 3, 3), (1, 5, 1, 2)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_with_batch_statistics(shape, affine, dtype):
    """F.batch_norm(x, None, None, weight, bias, training=True): mean and biased variance over
    (N, *spatial), as eager computes them (under no_grad an inference graph)."""
    c = shape[1]
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    w, b = (torch.randn(c).to(dtype), torch.randn(c).to(dtype)) if affine else (None, None)

    def norm(x, w, b):
        return F.batch_norm(x, None, None, w, b, training=True, eps=1e-3)

    if dtype.itemsize > 2:
        compile_and_compare(norm, x, w, b)
        return
    # 16-bit: eager's CPU kernel loses more than float32 statistics do where a channel's values
    # are close (Kiln takes them in float32): compare with eager in float32, rounded
    torch._dynamo.reset()
    with torch.no_grad():
        actual = torch.compile(norm, backend="kiln", fullgraph=True)(x, w, b)
        expected = norm(*(t if t is None else t.float() for t in (x, w, b))).to(dtype)
    torch.testing.assert_close(actual, expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_batch_norm_with_batch_statistics_non_contiguous():
    x = torch.randn(5, 6, 4, 3).permute(0, 3, 2, 1)        # (5, 3, 4, 6), channels not innermost
    compile_and_compare(lambda x: F.batch_norm(x, None, None, training=True), x)


def test_weight_standardization():
    """NFNet's WSConv2d: the weight standardized per output channel by batch_norm over the batch
    of one, then convolved."""
    class WSConv2d(nn.Conv2d):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gain = nn.Parameter(torch.randn(self.out_channels, 1, 1, 1))

        def forward(self, x):
            scale = self.weight[0].numel() ** -0.5
            weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                                  weight=(self.gain * scale).view(-1), training=True, momentum=0.0,
                                  eps=1e-6).reshape_as(self.weight)
            return F.conv2d(x, weight, self.bias, self.stride, self.padding)

    torch.manual_seed(0)
    model = WSConv2d(3, 8, 3, padding=1).eval()
    compile_and_compare(model, torch.randn(2, 3, 9, 7))


@pytest.mark.parametrize("traced", [False, True])
def test_batch_norm_without_running_statistics_module(traced):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2.0)
        model[1].bias.uniform_(-1.0, 1.0)
    x = torch.randn(3, 3, 7, 6)
    if traced:
        graph = run_traced(model, x)
        assert any(n.op == "call_module" and n.target == "1" for n in graph.graph.nodes)
    else:
        compile_and_compare(model, x)


def test_batch_norm_of_one_value_per_channel_is_declined():
    """PyTorch raises for one value per channel; Kiln's rule declines (the fallback gives eager's error)."""
    from kiln.frontend.torch import kiln_backend

    class Norm(nn.Module):
        def forward(self, x):
            return F.batch_norm(x, None, None, training=True)

    with pytest.raises(Exception, match="declined"), torch.no_grad():
        x = torch.randn(1, 4)
        kiln_backend(torch.fx.symbolic_trace(Norm()), [x])(x)


FOLD_CASES = [  # (input shape, output_size, kernel_size, dilation, padding, stride)
    ((2, 12, 20), (5, 6), 2, 1, 0, 1),
    ((1, 27, 9), (7, 7), 3, 1, 0, 2),
    ((3, 2 * 6, 12), (5, 7), (2, 3), 1, 1, (2, 2)),
    ((2, 3 * 4, 24), (6, 5), (2, 2), (2, 1), (1, 0), (1, 1)),
    ((18, 4), (4, 4), 3, 1, 1, 2),                      # unbatched
    ((1, 5 * 9, 4), (8, 8), 3, 2, 1, 3),                 # dilation 2, stride 3
    ((2, 4, 6), (2, 3), 1, 1, 0, 1),                     # 1x1: a reshape
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", FOLD_CASES, ids=str)
def test_fold(case, dtype):
    """F.fold (col2im): each output pixel sums the patch entries that cover it."""
    shape, output_size, kernel_size, dilation, padding, stride = case
    x = torch.randn(shape).to(dtype)
    compile_and_compare(lambda x: F.fold(x, output_size, kernel_size, dilation, padding, stride), x,
                        atol=TOL[dtype], rtol=TOL[dtype])


def test_fold_of_unfold_non_contiguous():
    """fold(unfold(x)) counts each pixel once per patch covering it; the columns transposed."""
    def roundtrip(x, cols):
        return F.fold(F.unfold(x, 3, padding=1, stride=2), (7, 9), 3, padding=1, stride=2), \
            F.fold(cols.transpose(1, 2), (7, 9), 3, padding=1, stride=2)

    compile_and_compare(roundtrip, torch.randn(2, 3, 7, 9), torch.randn(2, 20, 27))


def test_fold_operator_checks_its_shapes():
    import kiln
    from kiln.graph import OperatorError
    with pytest.raises(OperatorError, match="fold: input of shape"):
        kiln.ops.fold(torch.randn(2, 12, 19), (5, 6), 2)
    with pytest.raises(OperatorError, match="fold: expected a 2-D"):
        kiln.ops.fold(torch.randn(2, 2, 12, 20), (5, 6), 2)


X4 = (4, 5, 6, 3)
SETITEM_CASES = [  # (x shape, index: tensors as shapes of index tensors, value)
    ((4, 5), ("r", "c"), 2.5),
    ((4, 5), ("r", "c"), "tensor"),
    ((4, 5), ("r", "c"), "one"),
    ((7,), ("r",), "tensor"),
    (X4, ("r", "c"), "tensor"),                          # trailing dims kept: region (k, 6, 3)
    (X4, ("r", "c"), "row"),                             # value broadcast over the region
    (X4, (slice(None), "r", "c"), "tensor"),             # adjacent after a slice: (4, k, 3)
    (X4, ("r", slice(None), "c"), "tensor"),             # apart: index dims first, (k, 5, 3)
    (X4, (Ellipsis, "r", "c"), -1.0),
    (X4, ("r",), "tensor"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.int32])
@pytest.mark.parametrize("case", SETITEM_CASES, ids=str)
def test_setitem_with_index_tensors(case, dtype):
    """x[rows, cols] = v (operator.setitem with a tuple of index tensors), unique positions."""
    shape, index, value = case
    x = (torch.randn(shape) * 5).to(dtype)
    tensor_dims = [d for d, i in enumerate(index) if isinstance(i, str)]
    dims = [x.ndim - len(index) + d if Ellipsis in index else d for d in tensor_dims]
    k = min(x.shape[d] for d in dims)
    # unique positions: a permutation per indexed dim, the first k of each, some negative
    idx = [torch.randperm(x.shape[d])[:k] - (x.shape[d] if n % 2 else 0) for n, d in enumerate(dims)]
    items = iter(idx)
    key = tuple(next(items) if isinstance(i, str) else i for i in index)
    region = x[key].shape
    v = {"tensor": lambda: (torch.randn(region) * 5).to(dtype), "one": lambda: torch.tensor(7).to(dtype),
         "row": lambda: (torch.randn(region[-1]) * 5).to(dtype)}.get(value, lambda: value)()

    def write(x, v, *idx):
        items = iter(idx)
        y = x * 1
        y[tuple(next(items) if isinstance(i, str) else i for i in index)] = v
        return y

    compile_and_compare(write, x, v, *idx, atol=0, rtol=0)


def test_setitem_with_index_tensors_non_contiguous_and_lists():
    def write(x, rows, cols, v):
        y = x.t() * 1                               # (6, 4), not contiguous
        y[rows, cols] = v
        y[[0, 5], [3, 1]] = 9.0
        return y

    rows, cols = torch.tensor([[1, 2], [4, 3]]), torch.tensor([0, 3])   # broadcast: (2, 2)
    compile_and_compare(write, torch.randn(4, 6), rows, cols, torch.randn(5, 2)[::3])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(37, 5), (101,), (2, 3, 7)], ids=str)
@pytest.mark.parametrize("bins, low, high", [(10, -1, 1), (7, 0, 0), (5, -2.5, 3), (3, 1, 1), (1, -4, 4), (100, 0, 0)],
                         ids=str)
def test_histc(shape, bins, low, high, dtype):
    """torch.histc as on the CPU: bins over [min, max] (the data's range where min == max), values
    outside ignored, max counted in the last bin."""
    x = (torch.randn(shape) * 2).to(dtype)
    compile_and_compare(lambda x: torch.histc(x, bins, low, high), x, atol=0, rtol=0)
    compile_and_compare(lambda x: x.histc(bins=bins, min=low, max=high), x, atol=0, rtol=0)


def test_histc_edges_nan_constant_and_non_contiguous():
    edges = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 1.0, -1.0, 2.0, -3.0, float("nan"), 0.25])
    compile_and_compare(lambda x: torch.histc(x, 4, -1, 1), edges, atol=0, rtol=0)   # edges, max, NaN
    compile_and_compare(lambda x: torch.histc(x, 5), torch.full((6,), 2.5), atol=0, rtol=0)  # range 1.5..3.5
    compile_and_compare(lambda x: torch.histc(x, 6, -2, 2), torch.randn(9, 4).t(), atol=0, rtol=0)


def test_histc_of_integers_is_declined_on_the_cpu():
    """Eager's CPU histc takes floats only; Kiln's rule declines integers there."""
    from kiln.frontend.torch import kiln_backend

    class Histogram(nn.Module):
        def forward(self, x):
            return torch.histc(x, 4, 0, 3)

    with pytest.raises(Exception, match="histc.*declined"), torch.no_grad():
        x = torch.arange(6)
        kiln_backend(torch.fx.symbolic_trace(Histogram()), [x])(x)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bins, low, high", [(8, 0, 7), (5, 0, 0), (4, 2, 9), (3, -1.5, 3.7), (6, 4, 4)], ids=str)
def test_histc_of_integers_on_cuda(bins, low, high, dtype):
    """Integer histc, as mixture-of-experts layers count each expert's tokens on CUDA: bins computed
    in integer arithmetic, edges truncated to integers, counts in the input's dtype."""
    x = torch.randint(-3, 12, (97,), device="cuda", dtype=dtype)
    compile_and_compare(lambda x: torch.histc(x, bins, low, high), x, atol=0, rtol=0)
    compile_and_compare(lambda x: torch.histc(x, bins, low, high), x.view(-1, 1)[::2, 0] + 1, atol=0, rtol=0)


def test_histc_in_a_functionalized_graph():
    """A graph that writes through a view goes through AOTAutograd's functionalization, where
    histc reaches Kiln as aten.histc (DeepSeek-V3's expert counts)."""
    def counts(x):
        out = torch.zeros(6)
        out[1:5] = torch.histc(x, 4, -2, 2)
        return out

    compile_and_compare(counts, torch.randn(50), atol=0, rtol=0)


def _grouped_reference(x, weight, ends):
    """Row s times weight[g] for the group g whose rows it lies in (ends cumulative); zeros past
    the last end, in float64."""
    out, start = torch.zeros(x.shape[0], weight.shape[2], dtype=torch.float64), 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end].double() @ weight[g].double()
        start = end
    return out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows, ends", [(9, [2, 2, 7]), (13, [0, 5, 5, 13]), (1, [1]), (6, [0, 0]), (5, [])], ids=str)
def test_grouped_matmul_operator(rows, ends, dtype):
    """kiln.ops.grouped_matmul: each row by its group's matrix (empty groups, a group of every row,
    rows in no group, no groups at all), x not contiguous, against float64 next to eager's own
    error."""
    groups, k, n = len(ends), 11, 6
    x = rand((k, rows), dtype).t()
    weight = rand((groups, k, n), dtype)
    group = torch.bucketize(torch.arange(rows), torch.tensor(ends), right=True)
    got = kiln.ops.grouped_matmul(x, weight, group).torch()
    want = _grouped_reference(x, weight, torch.tensor(ends))
    eager = torch.stack([x[s] @ weight[g] if g < groups else torch.zeros(n, dtype=dtype)
                         for s, g in enumerate(group.tolist())])
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= 2 * (eager.double() - want).abs().max() + 1e-6


def test_grouped_matmul_declines_other_shapes():
    with pytest.raises(kiln.graph.OperatorError, match="grouped_matmul: expected x"):
        kiln.ops.grouped_matmul(torch.randn(4, 3), torch.randn(2, 3, 5), torch.zeros(4))
    with pytest.raises(kiln.graph.OperatorError, match="cannot multiply rows of 3"):
        kiln.ops.grouped_matmul(torch.randn(4, 3), torch.randn(2, 4, 5), torch.zeros(4, dtype=torch.int64))


def test_grouped_mm_through_dynamo():
    """torch._grouped_mm of rows sorted by group (bfloat16: the dtype its meta function takes;
    16-byte strides, as its CPU kernel needs); eager leaves the rows past the last end unwritten,
    so those are compared with zeros and the grouped rows with float64 next to eager's error."""
    x, weight = rand((10, 8), torch.bfloat16), rand((3, 8, 16), torch.bfloat16)
    ends = torch.tensor([3, 3, 8], dtype=torch.int32)
    with torch.no_grad():
        eager = torch._grouped_mm(x, weight, ends)
        got = torch.compile(lambda a, b, o: torch._grouped_mm(a, b, o), backend="kiln", fullgraph=True)(x, weight, ends)
    want = _grouped_reference(x, weight, ends)
    assert got.dtype == torch.bfloat16 and torch.equal(got[8:], torch.zeros(2, 16, dtype=torch.bfloat16))
    assert (got[:8].double() - want[:8]).abs().max() <= 2 * (eager[:8].double() - want[:8]).abs().max() + 1e-6


def test_transformers_grouped_mm_fallback():
    """transformers' own operator for the MoE product in dtypes torch._grouped_mm does not take
    (float32 under torch.compile), mapped by its name."""
    pytest.importorskip("transformers.integrations.moe")
    fallback = torch.ops.transformers.grouped_mm_fallback
    ends = torch.tensor([4, 4, 9, 11])
    compile_and_compare(lambda a, b, o: fallback(a, b, o), torch.randn(12, 5), torch.randn(4, 5, 7), ends,
                        atol=1e-5, rtol=1e-5)


def test_transformers_grouped_mm_fallback_backward():
    """Before: training a mixture-of-experts model in float32 (Mixtral, Qwen2-MoE) failed: the
    backward graph calls transformers' `grouped_mm_fallback_backward`, which no rule mapped.
    An empty group and rows past the last end included; both gradients against eager."""
    pytest.importorskip("transformers.integrations.moe")
    fallback = torch.ops.transformers.grouped_mm_fallback
    ends = torch.tensor([4, 4, 9, 11])

    def grads(fn, x, w):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        (fn(x, w, ends) * torch.linspace(-1, 2, 7)).square().sum().backward()
        return x.grad, w.grad

    x, w = torch.randn(12, 5), torch.randn(4, 5, 7)
    got = grads(torch.compile(lambda a, b, o: fallback(a, b, o), backend="kiln", fullgraph=True), x, w)
    want = grads(lambda a, b, o: fallback(a, b, o), x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0][11:], torch.zeros(1, 5)) and torch.equal(got[1][1], torch.zeros(5, 7))


@pytest.mark.parametrize("fn", [lambda x: x.mean(axis=2, keepdim=True), lambda x: torch.sum(x, axis=1, keepdims=True),
                                lambda x: x.amax(axis=-1), lambda x: torch.softmax(x, axis=1),
                                lambda x: torch.cat([x, x], axis=0)], ids=["mean", "sum", "amax", "softmax", "cat"])
def test_numpy_argument_names(fn):
    """Before: I-BERT's `x.mean(axis=2, keepdim=True)` failed to map; PyTorch's parser takes
    numpy's `axis` and `keepdims` for `dim` and `keepdim`, and so do the rules now."""
    compile_and_compare(fn, torch.randn(2, 5, 7))


@pytest.mark.parametrize("fn", [lambda x: torch.as_tensor(x, device=x.device) * 2,
                                lambda x: torch.as_tensor(x, dtype=torch.float64) + 1,
                                lambda x: torch.tensor(x.int(), dtype=torch.float32) - x],
                         ids=["as_tensor", "as_tensor_dtype", "tensor"])
def test_tensor_from_a_tensor(fn):
    """Before: TAPAS's `torch.as_tensor(ids, device=...)` of a tensor in the graph failed to map."""
    compile_and_compare(fn, torch.randn(3, 4) * 5)


def _masked_column(x, m):
    y = x * 1
    y[:, 0][m] = -10000.0                   # Longformer's global-attention mask, through a view
    return y


def _masked_column_added(x, m):
    y = x * 1
    y[:, 1].index_put_((m,), torch.tensor(2.5), accumulate=True)
    return y


@pytest.mark.parametrize("fn", [_masked_column, _masked_column_added], ids=["put", "accumulate"])
def test_one_mask_and_one_value_written_through_a_view(fn):
    """Before: Longformer failed: functionalized, `y[:, 0][m] = v` is ATen's index_put with a
    bool index, which the rule (integer indices) refused."""
    x = torch.randn(4, 6, 5)
    compile_and_compare(fn, x, x[:, 0, :2].sum(-1) > 0)


def _assign_masked(x, m, y):
    x = x.clone()
    x[m] = y
    return x


def _assign_masked_in_place(x, m, y):
    x[m] = y                                # the graph's input itself
    return x + 1


# x's shape, the mask's, the values' (none, or a row of 5 each)
EMPTY_ASSIGNMENTS = [((2, 1, 17), (2, 1, 17), (0,)), ((2, 3, 5), (2, 3), (0, 5))]


@pytest.mark.parametrize("fn", [_assign_masked, _assign_masked_in_place], ids=["clone", "in_place"])
@pytest.mark.parametrize("shapes", EMPTY_ASSIGNMENTS, ids=str)
def test_empty_values_written_where_the_mask_selects_nothing(shapes, fn):
    """Before: VITS failed to compile: `x[mask] = y` with an empty y (eager: valid where the mask
    selects nothing, then nothing changes) had no rule (MappingError: every rule for
    operator.setitem declined)."""
    x_shape, mask_shape, y_shape = shapes
    compiled = torch.compile(fn, backend="kiln", fullgraph=True)
    mask, y = torch.zeros(mask_shape, dtype=torch.bool), torch.empty(y_shape)
    torch._dynamo.reset()
    for _ in range(2):                      # fresh x each call
        x = torch.randn(x_shape)
        before = x.clone()
        expected = fn(x.clone(), mask, y)
        assert torch.equal(compiled(x, mask, y), expected) and torch.equal(x, before)


@pytest.mark.parametrize("fn", [_assign_masked, _assign_masked_in_place], ids=["clone", "in_place"])
@pytest.mark.parametrize("shapes", EMPTY_ASSIGNMENTS, ids=str)
def test_empty_values_written_where_the_mask_selects_something_raises_as_eager(shapes, fn):
    x_shape, mask_shape, y_shape = shapes
    mask, y = torch.zeros(mask_shape, dtype=torch.bool), torch.empty(y_shape)
    mask.view(-1)[[1, 4, 5]] = True
    with pytest.raises(RuntimeError, match=r"shape mismatch: value tensor of shape \[0"):
        fn(torch.randn(x_shape), mask, y)
    torch._dynamo.reset()
    rows = ", 5" if len(x_shape) > len(mask_shape) else ""
    with pytest.raises(RuntimeError, match=rf"index_put \(x\[mask\] = values\): shape mismatch: value tensor of "
                                           rf"shape \[0.*indexing result of shape \[3{rows}\]"):
        torch.compile(fn, backend="kiln", fullgraph=True)(torch.randn(x_shape), mask, y)


@pytest.mark.parametrize("count", [2, 3, 4])
def test_values_for_a_mask_must_be_as_many_as_it_selects(count):
    """Several values for a mask: eager raises unless there is one for each selected position
    (Kiln's masked_scatter repeated the last value, or left values out, silently)."""
    x, mask, y = torch.randn(4, 5), torch.zeros(4, 5, dtype=torch.bool), torch.randn(count)
    mask[[0, 2, 3], [1, 4, 0]] = True
    if count == 3:
        compile_and_compare(_assign_masked, x, mask, y, atol=0, rtol=0)
        return
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _assign_masked(x, mask, y)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=rf"shape \[{count}\] cannot be broadcast to indexing result of shape \[3\]"):
        torch.compile(_assign_masked, backend="kiln", fullgraph=True)(x, mask, y)


@pytest.mark.parametrize("shape", [(3, 5), (2, 0), (7,), ()], ids=str)
def test_one_hot_with_its_number_of_classes(shape):
    """Before: F.one_hot (mixture-of-experts routing in transformers' eager experts) was not
    mapped. With num_classes given the size is known; values outside it fail as eager does."""
    x = torch.randint(0, 6, shape)
    compile_and_compare(lambda x: F.one_hot(x, num_classes=6) * 3 - 1, x, atol=0, rtol=0)
    compile_and_compare(lambda x: F.one_hot(x.t() if x.ndim == 2 else x, 6).sum(0), x, atol=0, rtol=0)


@pytest.mark.parametrize("value", [6, -1])
def test_one_hot_of_a_value_outside_its_classes_raises_as_eager(value):
    fn = lambda x: F.one_hot(x, num_classes=6)  # noqa: E731
    x = torch.tensor([1, value, 2])
    with pytest.raises(RuntimeError):
        fn(x)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="one_hot: class value"):
        torch.compile(fn, backend="kiln", fullgraph=True)(x)


def test_one_hot_without_its_number_of_classes_is_declined():
    """Its size would come from the data (dynamo refuses it too; a symbolic_trace graph reaches
    Kiln, whose rule declines it, naming the call)."""
    from kiln.frontend.torch.backend import kiln_backend
    from kiln.frontend.torch.interpreter import MappingError

    class OneHot(nn.Module):
        def forward(self, x):
            return F.one_hot(x) + 1

    x = torch.tensor([0, 3, 1])
    with pytest.raises(MappingError, match="one_hot declined"):
        kiln_backend(torch.fx.symbolic_trace(OneHot()), [x])(x)
