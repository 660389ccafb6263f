"""Row kernels over rows that are not whole 16-byte packs (`kiln.schedule.cuda_rows`, peeled
rows): GPT-2's 50,257-logit rows, rows of 1027 (every row starts at another phase mod 8), a
few rows of 9, slices at odd offsets. Kiln's results against float64, at most twice eager
PyTorch's own error (plus a small absolute slack); both the kiln ops and torch.compile."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.schedule.cuda_kernels import BLOCK, TARGET_BLOCKS
from kiln.schedule.cuda_rows import ONLINE_LANES
from tests.support import rand

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]
ops = kiln.ops

DTYPES = (torch.float32, torch.bfloat16)
SHAPES = ((64, 1027), (64, 50257), (3, 9), (70, 5003))


def _err(got, want):
    return (got.double() - want).abs().max().item()


def _check(got, eager, want, slack=1e-5):
    """Kiln's error against the float64 `want` within twice eager's, plus `slack` of |want|."""
    top = want.abs().max().item()
    assert got.dtype == eager.dtype and tuple(got.shape) == tuple(want.shape)
    assert not torch.isnan(got).any()
    assert _err(got, want) <= 2 * _err(eager, want) + slack * max(top, 1.0), (_err(got, want), _err(eager, want))


def _f32(x):
    """`x` in float32, or float64 for the reference."""
    return x if x.dtype == torch.float64 else x.float()


def _ids(d):
    return str(d).replace("torch.", "")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("op", ("log_softmax", "softmax"))
def test_softmaxes_over_odd_rows(op, shape, dtype):
    torch.manual_seed(0)
    x = (rand(shape, dtype) * 4).cuda()
    got = getattr(ops, op)(kiln.from_torch(x), -1).torch()
    _check(got, getattr(torch, op)(x, -1), getattr(torch, op)(x.double(), -1))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_log_sum_exp_of_a_row_over_odd_rows(shape, dtype):
    """One value a row (cross-entropy's forward statistic)."""
    torch.manual_seed(0)
    x = (rand(shape, dtype) * 4).cuda()
    xk = kiln.from_torch(x)
    xf = ops.cast(xk, torch.float32)
    high = ops.amax(xf, [1], True)
    got = ops.add(ops.log(ops.sum(ops.exp(ops.sub(xf, high)), [1], True)), high).torch()
    _check(got, torch.logsumexp(x.float(), 1, keepdim=True), torch.logsumexp(x.double(), 1, keepdim=True))


@pytest.mark.parametrize("keep", (True, False))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_sum_and_amax_along_odd_rows(shape, dtype, keep):
    torch.manual_seed(0)
    x = rand(shape, dtype).cuda()
    xk = kiln.from_torch(x)
    _check(ops.sum(xk, [1], keep).torch(), x.sum(1, keep), x.double().sum(1, keep), slack=1e-4)
    _check(ops.amax(xk, [1], keep).torch(), x.amax(1, keep), x.double().amax(1, keep))


@pytest.mark.parametrize("shape", ((64, 50257), (64, 1027), (3, 9), (96, 5003)), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_cross_entropy_and_its_gradient_over_odd_rows(shape, dtype):
    """torch.compile of cross_entropy(reduction='sum') over logits of odd rows, and d(logits)
    (a row task reading the logits, writing a tensor of the same odd rows)."""
    torch.manual_seed(0)
    logits = (rand(shape, dtype) * 4).cuda()
    target = torch.randint(0, shape[1], (shape[0],), device="cuda")

    _check_loss_and_gradient(lambda x: F.cross_entropy(_f32(x), target, reduction="sum"), logits)


def _check_loss_and_gradient(loss_of, logits):
    """`loss_of(logits)` and d(logits), compiled by Kiln, against eager's and float64's."""
    def run(fn, x):
        x = x.detach().requires_grad_()
        loss = fn(x)
        (g,) = torch.autograd.grad(loss, x)
        return loss.detach(), g

    want = run(loss_of, logits.double())
    eager = run(loss_of, logits)
    got = run(torch.compile(loss_of, backend="kiln"), logits)
    for g, e, w in zip(got, eager, want):
        _check(g, e, w, slack=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("start, width", ((1, 1028), (8, 1035), (3, 50260)))
def test_softmaxes_of_slices_at_odd_offsets(start, width, dtype):
    """x[:, start:] inside a compiled function: the rows' loads start at another phase than the
    output's (start 1, 3) or the same one (start 8)."""
    torch.manual_seed(0)
    x = (rand((64, width), dtype) * 4).cuda()

    def fn(t):
        v = t[:, start:]
        return torch.log_softmax(v, -1), torch.softmax(v, -1), _f32(v).sum(-1)

    want = fn(x.double())
    eager = fn(x)
    got = torch.compile(fn, backend="kiln")(x)
    for g, e, w in zip(got, eager, want):
        _check(g, e, w, slack=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_kiln_ops_on_views_at_odd_offsets(dtype):
    """The kiln ops on a view whose rows start at odd offsets (the runtime copies inputs that
    are not aligned to the program's packs) and on one at an aligned, in-phase offset."""
    torch.manual_seed(0)
    base = (rand((64, 1028), dtype) * 4).cuda()
    for view in (base[:, 1:], base.view(-1)[5:5 + 64 * 1027].view(64, 1027)):
        got = ops.log_softmax(kiln.from_torch(view), -1).torch()
        _check(got, torch.log_softmax(view, -1), torch.log_softmax(view.double(), -1))
    xk = kiln.symbol((64, 1028), dtype, "cuda")
    graph = kiln.trace_from(ops.softmax(ops.slice(xk, 1, 1, None), -1), [xk])
    (got,) = graph.run([base])
    _check(got.torch(), torch.softmax(base[:, 1:], -1), torch.softmax(base[:, 1:].double(), -1))


def _causal_lm_loss(logits, labels):
    """transformers' ForCausalLMLoss: logits upcast, labels shifted left with -100, the mean
    cross-entropy over the tokens not ignored."""
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(_f32(logits).view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


@pytest.mark.parametrize("rows, vocab", ((512, 50257), (72, 50257), (2048, 1027), (136, 1027)), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_causal_lm_loss_and_its_gradient(rows, vocab, dtype):
    """GPT-2's loss graph and its backward (log-sum-exp in one pass over each row, the
    log-softmax backward in packs): loss and d(logits) against float64."""
    torch.manual_seed(0)
    logits = (rand((rows // 8, 8, vocab), dtype) * 4).cuda()
    labels = torch.randint(0, vocab, (rows // 8, 8), device="cuda")
    labels[0, 3] = -100

    _check_loss_and_gradient(lambda x: _causal_lm_loss(x, labels), logits)


@pytest.mark.parametrize("width", (1027, 50257, 65536))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_log_sum_exp_and_softmax_of_rows_with_infinities(width, dtype):
    """Rows with -inf entries, a row all -inf, rows holding +inf or NaN: where the online pass
    over a row meets a maximum that is not finite, the sum is taken again from the row (NaN
    where eager gives NaN, the same values elsewhere)."""
    torch.manual_seed(0)
    x = (rand((96, width), dtype) * 4).cuda()
    x[:, ::7] = float("-inf")
    x[5] = float("-inf")
    x[9, 100] = float("inf")
    x[13, 3] = float("nan")

    def fn(t):
        return torch.logsumexp(_f32(t), -1), torch.softmax(_f32(t), -1)

    got, eager = torch.compile(fn, backend="kiln")(x), fn(x)
    for g, e in zip(got, eager):
        assert torch.equal(torch.isnan(g), torch.isnan(e))
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)


def _many_rows():
    """Rows enough that the online pass takes its narrower blocks (`cuda_rows.online_plan`)."""
    return -(-TARGET_BLOCKS * BLOCK // ONLINE_LANES)


@pytest.mark.parametrize("width", (50257, 1027, 7, 1))
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_online_rows_of_many_rows(width, dtype):
    """The online pass in groups of packs over as many rows as take its narrower blocks:
    log-sum-exp, log-softmax, cross-entropy and its gradient against float64; then rows with
    -inf entries (the row's first and last elements too: the packs the row does not fill), a
    row all -inf, +inf, NaN, both, at the row's ends: NaN where eager has NaN, eager's values
    elsewhere."""
    torch.manual_seed(0)
    rows = _many_rows()
    x = (rand((rows, width), dtype) * 4).cuda()

    def fn(t):
        return torch.logsumexp(_f32(t), -1), torch.log_softmax(_f32(t), -1)

    compiled = torch.compile(fn, backend="kiln")
    for g, e, w in zip(compiled(x), fn(x), fn(x.double())):
        _check(g, e, w, slack=1e-5)
    target = torch.randint(0, width, (rows,), device="cuda")
    _check_loss_and_gradient(lambda t: F.cross_entropy(_f32(t), target, reduction="sum"), x)

    last = width - 1
    x[:, ::7] = float("-inf")
    x[:64, last] = float("-inf")
    x[5] = float("-inf")
    x[9, 0] = float("inf")
    x[13, last] = float("nan")
    x[17, last // 2] = float("inf")
    x[17, last] = float("nan")
    x[21, last] = float("inf")
    for g, e in zip(compiled(x), fn(x)):
        assert torch.equal(torch.isnan(g), torch.isnan(e))
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)
