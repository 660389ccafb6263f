"""aten.as_strided and as_strided_scatter in training graphs: they read and write the input's
storage as PyTorch traced it (strides and storage offset; channels_last holds channels
innermost), never as if it were contiguous, and raise a clear error where Kiln's values cannot
show the storage. Forward and every gradient against eager, on inputs of the layouts given."""
import pytest
import torch
import torch.nn.functional as F

from training_support import check

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def layouts():
    """Inputs of several dense layouts, by name: contiguous, channels_last, dims swapped, and a
    row slice (a storage offset)."""
    torch.manual_seed(0)
    return {
        "contiguous": torch.randn(2, 3, 4, 5),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "transposed": torch.randn(2, 5, 4, 3).transpose(1, 3),
        "offset": torch.randn(3, 3, 4, 5)[1:],
    }


def compare(fn, x, rtol=1e-5, atol=1e-6):
    """fn(x) and its gradient by x, Kiln against eager, on `x` in its own layout (a leaf that
    shares its storage)."""
    leaf = x.detach().requires_grad_(True)
    out = torch.compile(fn, backend="kiln")(leaf)
    weights = torch.randn(out.shape)
    (out * weights).sum().backward()
    got, leaf.grad = leaf.grad, None
    expected = fn(leaf)
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(got, leaf.grad, rtol=rtol, atol=atol)


def _view(x, view):
    """(size, stride, storage offset) of `view(x)`, in `x`'s own storage."""
    v = view(x)
    return v.shape, v.stride(), v.storage_offset()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "offset"])
def test_as_strided_reads_the_traced_storage(layout):
    x = layouts()[layout]
    # a logical view (slice, step, swapped dims), rebuilt by as_strided from x's own strides
    size, stride, offset = _view(x, lambda t: t[:, 1:, ::2].transpose(1, 3))
    compare(lambda t: torch.as_strided(t, size, stride, offset) * 2, x)
    # storage order itself: every third element of x's storage, which only x's layout tells
    compare(lambda t: torch.as_strided(t, (t.numel() // 3,), (3,), t.storage_offset() + 1).exp(), x)
    # overlapping windows read (each element in several), and the default storage offset
    compare(lambda t: torch.as_strided(t, (7, 4), (5, 3)).sin(), x)


def test_one_function_called_with_two_layouts_of_one_shape():
    """Kiln's graphs are keyed by shapes, not strides: the second layout must not reuse the
    first one's reading of the storage."""
    fn = torch.compile(lambda t: torch.as_strided(t, (2, 3, 4), (60, 1, 15)) * 2, backend="kiln")
    for x in (layouts()["contiguous"], layouts()["channels_last"]):
        leaf = x.detach().requires_grad_(True)
        torch.testing.assert_close(fn(leaf), x.as_strided((2, 3, 4), (60, 1, 15)) * 2)


def test_write_through_a_strided_view_of_a_channels_last_tensor():
    """Functionalization makes the write an as_strided_scatter into y's channels_last storage."""
    def fn(t):
        y = F.relu(t) + 1
        torch.as_strided(y, (2, 4, 5), (60, 15, 3), 1).mul_(3)     # channel 1 of each image
        return y * t
    compare(fn, layouts()["channels_last"])


def test_as_strided_of_a_sliced_intermediate():
    """The slice of a fresh (4, 5) tensor starts at storage offset 5 in the trace: offset 7 is
    its element 2."""
    compare(lambda t: torch.as_strided((t * 2)[1:], (3, 2), (1, 5), 7) * 3, torch.randn(4, 5))


@pytest.mark.parametrize("fn, x, message", [
    (lambda t: torch.as_strided(t, (2, 3), (1, 12), t.storage_offset() + 1),
     torch.randn(5, 12)[1:, :4], "does not fill its storage densely"),
    (lambda t: torch.as_strided(t, (3, 4), (4, 1), 5), torch.randn(3, 4),
     "size (3, 4), stride (4, 1) and storage offset 5 do not describe a view of the 12 elements"),
], ids=["gaps", "past-the-end"])
def test_storage_kiln_cannot_show_is_a_clear_error(fn, x, message):
    leaf = x.detach().requires_grad_(True)
    with pytest.raises(NotImplementedError) as info:
        torch.compile(fn, backend="kiln")(leaf)
    assert message in str(info.value) and "aten.as_strided.default" in str(info.value)


def test_diagonal_and_diagonal_scatter():
    torch.manual_seed(0)
    x = torch.randn(3, 6, 5)
    check(lambda t: t.diagonal(1, 0, 2) * t.diagonal(-2, 1, 2).sum(), x)
    check(lambda t: torch.diagonal_scatter(t, t.diagonal(0, 1, 2).exp(), 0, 1, 2), x)
