"""CPU values inside graphs on a GPU, as PyTorch combines them (issue 30): tensors a forward builds
on the CPU and moves with `.to(device)` (position buckets, masks, scales), a CPU scalar combined
with CUDA tensors, and a CPU scalar passed as an argument (read on the GPU at each call), each
against eager."""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


def _check(fn, *args):
    want = fn(*args)
    got = torch.compile(fn, backend="kiln", fullgraph=True)(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return got


def test_scalar_built_in_forward_times_cuda_tensor():
    _check(lambda x: x * torch.tensor(2.5) + torch.tensor(1.0), torch.randn(7, 33, device="cuda"))


def test_positions_built_on_the_cpu_and_moved():
    def f(x):
        positions = torch.arange(x.shape[-1]).to(x.device)
        buckets = torch.clamp(positions // 4, max=5).to(x.dtype)
        return x + buckets
    _check(f, torch.randn(3, 29, device="cuda"))


def test_mask_built_on_the_cpu_and_moved():
    """nn.Transformer's square subsequent mask, made on the CPU and moved to the scores' device."""
    def f(q, k):
        n = q.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1).to(q.device)
        return torch.softmax(q @ k.transpose(1, 2) + mask, -1)
    _check(f, torch.randn(2, 9, 16, device="cuda"), torch.randn(2, 9, 16, device="cuda"))


def test_cpu_tensor_moved_with_cuda():
    _check(lambda x: x - torch.linspace(0, 1, x.shape[-1]).cuda(), torch.randn(4, 17, device="cuda"))


def test_cpu_scalar_argument_is_read_at_each_call():
    f = torch.compile(lambda x, s: torch.tanh(x * s), backend="kiln")
    x = torch.randn(5, 40, device="cuda")
    for value in (0.5, -2.0, 3.25):
        s = torch.tensor(value)
        torch.testing.assert_close(f(x, s), torch.tanh(x * s), atol=1e-6, rtol=1e-6)


def test_module_with_a_cpu_scale_attribute():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(24, 24)
            self.scale = torch.tensor(0.125)         # a plain attribute: stays on the CPU

        def forward(self, x):
            return self.linear(x) * self.scale

    model = Scaled().cuda()
    _check(model, torch.randn(6, 24, device="cuda"))


@pytest.mark.parametrize("index", [torch.tensor([True, False, True, True, False]), torch.tensor([3, 0, 3]),
                                   torch.tensor([[1], [4]])], ids=["mask", "positions", "positions-2d"])
def test_cpu_index_tensors_of_cuda_tensors(index):
    """CPU index tensors passed to a graph on a GPU, as PyTorch's indexing takes them (OpInfo's
    index_put samples do): reading (positions; a mask's read has a data-dependent size),
    writing and index_put."""
    x = torch.randn(5, 6, device="cuda")
    values = torch.randn(6, device="cuda")
    if not index.dtype == torch.bool:
        _check(lambda x, i: x[i] * 2, x, index)
    _check(lambda x, i, v: torch.index_put(x, (i,), v), x, index, values)
    _check(lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True), x, index, values)

    def write(x, i, v):
        y = x * 1
        y[i] = v
        return y
    _check(write, x, index, values)
