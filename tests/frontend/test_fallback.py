"""fallback_to_eager covers every node Kiln cannot compile: unmapped operators, operators whose
rules all decline the arguments, and tensors of dtypes Kiln does not support."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln


@pytest.fixture(autouse=True)
def fallback():
    torch._dynamo.reset()
    kiln.torch.dynamo_config.fallback_to_eager(True)
    yield
    kiln.torch.dynamo_config.reset()
    torch._dynamo.reset()


class Upsample(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = F.interpolate(self.conv(x), scale_factor=2, mode="bicubic", align_corners=False, antialias=True)
        return torch.relu(y) * 2 + 1


def _compiled_backends(model):
    kinds = []

    def backend(gm, inputs):
        compiled = kiln.torch.kiln_backend(gm, inputs)
        kinds.append(type(compiled).__name__)
        return compiled

    return torch.compile(model, backend=backend), kinds


def test_antialiased_bicubic_interpolate_runs_in_pytorch_and_the_rest_in_kiln():
    torch.manual_seed(0)
    model, x = Upsample().eval(), torch.randn(2, 3, 5, 7)
    compiled, kinds = _compiled_backends(model)
    with pytest.warns(UserWarning, match="(?s)Kiln runs these nodes in PyTorch.*interpolate.*bicubic"):
        with torch.no_grad():
            out = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    assert kinds == ["GraphModule"]         # split: Kiln parts around the PyTorch node


def test_a_complex_intermediate_runs_in_pytorch():
    """The complex exp has no Kiln rule: it runs in PyTorch, and so do the complex values that
    would cross between Kiln and PyTorch (Kiln's parts take and give real tensors)."""
    def rotate(x, angle):
        c = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2) * 2)
        turned = c * torch.exp(1j * angle)
        return torch.view_as_real(turned).flatten(-2).relu() + x

    x, angle = torch.randn(3, 8), torch.randn(4)
    compiled, _ = _compiled_backends(rotate)
    with pytest.warns(UserWarning, match="(?s)view_as_complex.*exp.*view_as_real"):
        out = compiled(x, angle)
    torch.testing.assert_close(out, rotate(x, angle))


def test_a_complex_cast_is_named_with_its_dtype():
    def fn(x):
        c = (x * 2).to(torch.complex64)
        return (c * c).abs() + 1

    x = torch.randn(2, 5)
    compiled, _ = _compiled_backends(fn)
    with pytest.warns(UserWarning, match="complex64"):
        out = compiled(x)
    torch.testing.assert_close(out, fn(x))


def test_train_mode_dropout_runs_in_pytorch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.ReLU()).train()
    x = torch.randn(4, 6)
    compiled, _ = _compiled_backends(model)
    with torch.no_grad(), pytest.warns(UserWarning, match="dropout"):  # the torch-level path
        torch.manual_seed(1)
        out = compiled(x)
    torch.manual_seed(1)
    torch.testing.assert_close(out, model(x))


def _pad_by_tensors(x, left, right):
    """EnCodec's reflect padding (`EncodecConv1d._pad1d`): amounts are 0-dim tensors, so the
    padded length is a size dynamo takes from their values."""
    padded = F.pad(x, (left, right), "reflect")
    return padded[..., :padded.shape[-1] - 1] * 2


def _nonzero_between(x):
    a = torch.relu(x)
    i = torch.nonzero(a)
    return (a + 1).sum() * i.shape[0] + i.sum()


def test_nonzero_in_the_middle_of_a_graph_runs_in_pytorch():
    x = torch.randn(4, 5)
    compiled, kinds = _compiled_backends(_nonzero_between)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), \
            pytest.warns(UserWarning, match="nonzero"):
        out = compiled(x)
    torch.testing.assert_close(out, _nonzero_between(x))
    assert kinds == ["GraphModule"]


@pytest.mark.parametrize("fn, make", [
    (_pad_by_tensors, lambda: (torch.randn(1, 4, 37), torch.tensor(5), torch.tensor(1))),
    (_nonzero_between, lambda: (torch.randn(4, 5),)),
])
def test_split_passes_sizes_made_in_pytorch_to_later_parts(fn, make):
    """pad, nonzero and the size read from nonzero's result each alone in PyTorch, the rest in
    parts: a size defined by no node (a 0-dim tensor's value) or by a node reading the value
    from another part (sym_size of nonzero's result) is no input of a part."""
    from kiln.frontend.torch.partition import split

    def backend(gm, inputs):
        sizing = {F.pad, torch._C._nn.pad, torch.nonzero, torch.ops.aten.sym_size.int}
        return split(gm, {n for n in gm.graph.nodes if n.target in sizing}, lambda part: part)

    inputs = make()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = torch.compile(fn, backend=backend)(*inputs)
    torch.testing.assert_close(out, fn(*inputs))


def test_pad_by_tensor_amounts_after_a_graph_break_matches_eager():
    """EnCodec's padding under fallback: the amounts, dynamo's 0-dim tensor inputs, are read as
    the trace's constants (traced again for new ones). In a symbolic_trace graph their values
    are known only when it runs: that pad runs in PyTorch, the rest in Kiln."""
    compiled, _ = _compiled_backends(_pad_by_tensors)
    for left, right in ((5, 1), (3, 2)):
        x, left, right = torch.randn(1, 4, 37), torch.tensor(left), torch.tensor(right)
        torch.testing.assert_close(compiled(x, left, right), _pad_by_tensors(x, left, right))

    gm = torch.fx.symbolic_trace(_pad_by_tensors)
    x, left, right = torch.randn(1, 4, 37), torch.tensor(4), torch.tensor(2)
    with pytest.warns(UserWarning, match="(?s)Kiln runs these nodes in PyTorch.*pad"):
        compiled = kiln.torch.kiln_backend(gm, [x, left, right])
    assert isinstance(compiled, torch.fx.GraphModule)
    torch.testing.assert_close(compiled(x, left, right), _pad_by_tensors(x, left, right))


def test_a_boolean_mask_read_runs_in_pytorch_for_each_count():
    """x[mask] has a size only its values give: dynamo checks it with aten._assert_scalar (size
    arithmetic, run in Python), the read itself runs in PyTorch, for masks of different counts."""
    compiled = torch.compile(lambda x, m: x[m] * 2 + 1, backend="kiln", fullgraph=True)
    x, mask = torch.randn(5, 6), torch.tensor([True, False, True, True, False])
    with pytest.warns(UserWarning, match="getitem"):
        torch.testing.assert_close(compiled(x, mask), x[mask] * 2 + 1)
    for mask in ([True] * 5, [False] * 5, [False, True, False, False, False]):
        mask = torch.tensor(mask)
        torch.testing.assert_close(compiled(x, mask), x[mask] * 2 + 1)


def test_a_boolean_mask_read_without_fallback_names_the_read():
    kiln.torch.dynamo_config.fallback_to_eager(False)
    compiled = torch.compile(lambda x, m: x[m] * 2, backend="kiln", fullgraph=True)
    with pytest.raises(Exception, match=r"operator.getitem declined the arguments \(float32\[5, 6\]"):
        compiled(torch.randn(5, 6), torch.tensor([True, False, True, True, False]))
