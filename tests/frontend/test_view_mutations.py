"""Graphs that change tensors in place through views: the backend functionalizes them through
AOTAutograd and Kiln compiles the ATen graph (no warning, no PyTorch fallback), giving eager's
values and eager's changes to the caller's tensors."""
import copy
import warnings

import pytest
import torch
from torch import nn

import kiln
from kiln.frontend.torch.backend import KilnFunction


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _check(fn, *args, grad=False):
    """Run `fn` eagerly on copies of `args` and compiled by Kiln on `args`: equal results, equal
    inputs afterwards (buffers too, for a module), no warning, and every graph run by Kiln."""
    eager_fn, eager_args = copy.deepcopy(fn), copy.deepcopy(args)
    expected = eager_fn(*eager_args)
    before = KilnFunction.live()
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("error")
        actual = torch.compile(fn, backend="kiln")(*args)
    created = [f for f in KilnFunction.live() if not any(f is b for b in before)]
    assert created and all(f.graphs for f in created)      # traced and run by Kiln
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(args, eager_args)
    if isinstance(fn, nn.Module):
        torch.testing.assert_close(dict(fn.named_buffers()), dict(eager_fn.named_buffers()))
    return created


def _select_add(x):
    x[1].add_(1)
    return x * 2


def _view_mul(x):
    x.view(-1).mul_(2)
    return x.sum(0)


def _diagonal_and_transposed_row(x):
    x.diagonal().add_(3)
    x.t()[0].mul_(2)
    return x.relu()


def _as_strided(x):
    torch.as_strided(x, (2, 3), (1, 4), 1).add_(1)
    return x - 1


def _unbound(x):
    a, b, *_ = x.unbind(0)
    a.add_(b)
    return x.mean()


def _strided_fill_and_reshaped_slice(x):
    x[::2].fill_(1.5)
    x.reshape(-1)[3:7].mul_(-1)
    return x.exp()


@pytest.mark.parametrize("fn", [_select_add, _view_mul, _diagonal_and_transposed_row, _as_strided,
                                _unbound, _strided_fill_and_reshaped_slice],
                         ids=lambda f: f.__name__)
def test_writes_through_views_of_an_input_change_the_callers_tensor(fn):
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    before = x.clone()
    _check(fn, x)
    assert not torch.equal(x, before)


def test_writes_through_views_under_grad_mode():
    torch.manual_seed(0)
    _check(_select_add, torch.randn(3, 5), grad=True)


def test_dynamic_shapes_at_new_sizes():
    compiled = torch.compile(_views_read_after_their_base_changed, backend="kiln", dynamic=True)
    torch.manual_seed(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (3, 6, 9):
            x = torch.randn(rows, 4)
            eager_x = x.clone()
            torch.testing.assert_close(compiled(x), _views_read_after_their_base_changed(eager_x))
            torch.testing.assert_close(x, eager_x)

def _written_at_int(x, y):
    out = x.new_zeros(5, 4)
    rows = out[2:]
    out[3] = y[0]
    out[-1] = 2.5
    return rows * x.sum()


def _written_at_slices(x, y):
    out = x.new_zeros(5, 4)
    column = out[:, 3]
    out[1:3] = y
    out[:, 3:] = x[:5, :1]
    return out + column.sum()


def _written_at_indices(x, y, i):
    out = x.new_zeros(5, 4)
    out[i] = y
    return out - x[:5]


def _written_at_indices_of_a_row(x, y, i):
    out = x.new_zeros(5, 4)
    out[2][i - 1] = y[0, :2]
    out.view(-1)[0] = 5
    return out * 3


@pytest.mark.parametrize("fn", [_written_at_int, _written_at_slices], ids=lambda f: f.__name__)
def test_writes_into_a_new_tensor(fn):
    torch.manual_seed(0)
    _check(fn, torch.randn(6, 4), torch.randn(2, 4))


@pytest.mark.parametrize("fn", [_written_at_indices, _written_at_indices_of_a_row],
                         ids=lambda f: f.__name__)
def test_writes_into_a_new_tensor_at_index_tensors(fn):
    torch.manual_seed(0)
    _check(fn, torch.randn(6, 4), torch.randn(2, 4), torch.tensor([4, 0]))


def _ranked_into_a_transposed_buffer(x):
    out = torch.empty_like(x.t())
    out.copy_(x.sort(0, descending=True)[0].t())
    out[:, :2].copy_(x.t().topk(2, dim=1)[0])
    out[0].add_(x.sort(stable=True)[1][:, 0])
    return out


def test_sorts_into_a_transposed_buffer():
    """ATen's sort, topk and empty_permuted (empty_like of a transposed tensor)."""
    torch.manual_seed(0)
    [ranked] = _check(_ranked_into_a_transposed_buffer, torch.randn(5, 4))
    targets = {n.target for n in ranked.gm.graph.nodes}
    aten = torch.ops.aten
    assert {aten.empty_permuted.default, aten.sort.default, aten.sort.stable, aten.topk.default} <= targets

def _views_read_after_their_base_changed(x):
    v = x.view(-1)
    row = x[1]
    x.mul_(2)
    return v * 1, row.sum(), v


def test_views_read_after_their_base_changed():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    _check(_views_read_after_their_base_changed, x)


class _RunningState(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.randn(4, 6))

    def forward(self, x):
        self.state[1:3].mul_(0.5).add_(x.sum(0))
        self.state.view(-1)[:2].copy_(x[0, :2])
        return self.state * x.mean()


def test_a_module_changing_views_of_its_buffer():
    torch.manual_seed(0)
    model = _RunningState()
    before = model.state.clone()
    _check(model, torch.randn(3, 6))
    assert not torch.equal(model.state, before)


class _SSDLiteBlock(nn.Module):
    """Images copied into a padded batch, a small backbone, and two heads whose outputs are
    written by slices into one preallocated tensor (torchvision's transform and SSDlite head)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6())
        self.down = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8),
                                  nn.BatchNorm2d(8), nn.ReLU6())
        self.heads = nn.ModuleList([nn.Conv2d(8, 6, 1), nn.Conv2d(8, 6, 1)])

    def forward(self, images):
        batch = images[0].new_zeros((len(images), 3, 8, 8))
        for i, image in enumerate(images):
            batch[i, :, :image.shape[1], :image.shape[2]].copy_(image)
        near = self.body(batch)
        far = self.down(near)
        first, second = near.shape[2] * near.shape[3] * 2, far.shape[2] * far.shape[3] * 2
        scores = batch.new_zeros(len(images), first + second, 3)
        scores[:, :first] = self.heads[0](near).permute(0, 2, 3, 1).reshape(len(images), -1, 3)
        scores.narrow(1, first, second).copy_(
            self.heads[1](far).permute(0, 2, 3, 1).reshape(len(images), -1, 3))
        return scores.softmax(-1)


def test_an_ssdlite_like_block_is_compiled_by_kiln():
    torch.manual_seed(0)
    model = _SSDLiteBlock().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
    created = _check(model, [torch.randn(3, 8, 7), torch.randn(3, 6, 8)])
    targets = {n.target for f in created for n in f.gm.graph.nodes}
    assert torch.ops.aten.convolution.default in targets


def test_with_fallback_to_eager_every_node_is_still_kilns():
    """The check for nodes to run in PyTorch works on AOTAutograd's graph outside its fake
    mode (inside it, rules that build constants failed and their nodes went to PyTorch)."""
    kiln.torch.dynamo_config.fallback_to_eager(True)
    torch.manual_seed(0)
    _check(_SSDLiteBlock().eval(), [torch.randn(3, 8, 7), torch.randn(3, 6, 8)])

def test_parameters_and_buffers_left_unchanged_are_constants_of_the_graph():
    """As on the torch-level path: constants, checked at every call (an in-place change to a
    weight is seen); a buffer the graph changes stays an input."""
    torch.manual_seed(0)
    model = _SSDLiteBlock().eval()
    images = [torch.randn(3, 8, 7), torch.randn(3, 6, 8)]
    [block] = _check(model, images)
    assert block.constant == [False, False] + [True] * 16     # images; weights, statistics
    with torch.no_grad():
        model.heads[1].weight.mul_(2)
        torch.testing.assert_close(torch.compile(model, backend="kiln")(images), model(images))
    [state] = _check(_RunningState(), torch.randn(3, 6))
    assert not any(state.constant)

def test_a_graph_aotautograd_fails_on_runs_in_pytorch_with_a_warning(monkeypatch):
    import kiln.frontend.torch.backend as backend

    def failing(gm, example_inputs, compile_aten):
        raise RuntimeError("cannot functionalize")

    monkeypatch.setattr(backend, "compile_for_training", failing)
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    eager_x = x.clone()
    expected = _select_add(eager_x)
    with pytest.warns(UserWarning, match="(?s)through views.*cannot functionalize"):
        actual = torch.compile(_select_add, backend="kiln")(x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(x, eager_x)


@pytest.mark.cuda
def test_on_cuda_every_call_changes_the_callers_tensors():
    """CUDA graphs replayed: each call updates the input and the buffer as eager does."""
    torch.manual_seed(0)
    model = _RunningState().cuda()
    eager = copy.deepcopy(model)
    compiled_model = torch.compile(model, backend="kiln")
    compiled_select = torch.compile(_select_add, backend="kiln")
    x = torch.randn(3, 5, device="cuda")
    eager_x = x.clone()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            y = torch.randn(3, 6, device="cuda")
            torch.testing.assert_close(compiled_model(y), eager(y))
            torch.testing.assert_close(model.state, eager.state)
            torch.testing.assert_close(compiled_select(x), _select_add(eager_x))
            torch.testing.assert_close(x, eager_x)


@pytest.mark.cuda
def test_an_ssdlite_like_block_on_cuda():
    torch.manual_seed(0)
    model = _SSDLiteBlock().eval().cuda()
    _check(model, [torch.randn(3, 8, 7, device="cuda"), torch.randn(3, 6, 8, device="cuda")])
