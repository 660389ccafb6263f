"""Inputs where Kiln once returned a wrong value without a word: integer division by zero and
out-of-range indices now raise as eager PyTorch does (on the CPU; a trap on a GPU)."""
import pytest
import torch
from torch import nn

import kiln
from kiln.runtime.kernel_errors import KernelError
from tests.support import assert_close

INT_TYPES = (torch.int32, torch.int64)

DIVISIONS = {
    "floor_divide": lambda a, b: a // b,
    "remainder": lambda a, b: a % b,
    "fmod": torch.fmod,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
}


def _eager_error(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.type


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="kiln")


@pytest.mark.parametrize("dtype", INT_TYPES)
@pytest.mark.parametrize("name", sorted(DIVISIONS))
def test_integer_division_by_a_zero_tensor_element_raises_as_eager(name, dtype):
    fn = DIVISIONS[name]
    a = torch.randint(-50, 50, (7, 5), dtype=dtype)
    b = torch.randint(1, 9, (7, 5), dtype=dtype) * torch.where(torch.rand(7, 5) < 0.5, -1, 1).to(dtype)
    compiled = _compiled(fn)
    assert_close(compiled(a, b), fn(a, b))         # nonzero divisors: eager's values
    b[3, 2] = 0
    eager_type = _eager_error(fn, a, b)            # RuntimeError('ZeroDivisionError') in torch
    with pytest.raises(eager_type, match="integer division by zero") as info:
        compiled(a, b)
    assert isinstance(info.value, ZeroDivisionError)


@pytest.mark.parametrize("dtype", INT_TYPES)
@pytest.mark.parametrize("name", sorted(DIVISIONS))
def test_integer_division_by_a_zero_scalar_raises(name, dtype):
    a = torch.randint(-50, 50, (6,), dtype=dtype)
    with pytest.raises(ZeroDivisionError, match="integer division by zero"):
        _kiln_division(name, a, 0)


def _kiln_division(name, a, b):
    ops = kiln.ops
    return {"floor_divide": lambda: ops.floor_divide(a, b), "remainder": lambda: ops.remainder(a, b),
            "fmod": lambda: ops.fmod(a, b), "div_trunc": lambda: ops.div(a, b, rounding_mode="trunc"),
            "div_floor": lambda: ops.div(a, b, rounding_mode="floor")}[name]()


def test_float_division_by_zero_still_gives_inf_and_nan():
    a = torch.tensor([1.5, -2.0, 0.0])
    b = torch.zeros(3)
    for fn in (lambda x, y: x // y, lambda x, y: x % y, torch.fmod):
        assert_close(_compiled(fn)(a, b), fn(a, b))


def test_embedding_out_of_range_indices_raise_as_eager():
    torch.manual_seed(0)
    model = nn.Embedding(5, 2).eval()
    compiled = _compiled(model)
    good = torch.tensor([[4, 0, 2]])
    assert_close(compiled(good), model(good))
    for bad in (1000, -1, 5):
        ids = torch.tensor([1, bad])
        with pytest.raises(IndexError):
            model(ids)
        with pytest.raises(IndexError, match=f"embedding: index {bad} is out of range"):
            compiled(ids)


def test_gather_out_of_range_and_negative_indices_raise_runtime_error_as_eager():
    x = torch.randn(5, 3)
    fn = _compiled(lambda x, i: torch.gather(x, 0, i))
    ok = torch.tensor([[4, 0, 2], [1, 1, 3]])
    assert_close(fn(x, ok), torch.gather(x, 0, ok))
    for bad in (5, -1):
        index = torch.tensor([[0, bad, 0]])
        with pytest.raises(RuntimeError):
            torch.gather(x, 0, index)
        with pytest.raises(RuntimeError, match=f"gather: index {bad} is out of bounds for dimension 0"):
            fn(x, index)


def test_index_select_rejects_negative_and_out_of_range_indices_as_eager():
    x = torch.randn(4, 6)
    fn = _compiled(lambda x, i: torch.index_select(x, 1, i))
    ok = torch.tensor([5, 0, 3], dtype=torch.int32)
    assert_close(fn(x, ok), torch.index_select(x, 1, ok))
    for bad in (6, -1):
        index = torch.tensor([0, bad])
        eager_type = _eager_error(torch.index_select, x, 1, index)   # IndexError or RuntimeError
        with pytest.raises(eager_type, match=f"index_select: index {bad} is out of range"):
            fn(x, index)


def test_tensor_indexing_wraps_negative_indices_and_raises_out_of_range():
    x = torch.randn(5, 3)
    one = _compiled(lambda x, i: x[i] * 2)
    two = _compiled(lambda x, i, j: x[i, j] + 1)
    wrapping = torch.tensor([-1, 2, -5, 4])
    assert_close(one(x, wrapping), x[wrapping] * 2)
    assert_close(two(x, torch.tensor([0, -1]), torch.tensor([-3, 2])),
                 x[torch.tensor([0, -1]), torch.tensor([-3, 2])] + 1)
    for bad in (5, -6):
        with pytest.raises(IndexError):
            x[torch.tensor([bad])]
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds for dimension 0 with size 5"):
            one(x, torch.tensor([0, bad]))
    # in range of the flattened (5 * 3) rows, out of range of dim 1: still an error
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 1 with size 3"):
        two(x, torch.tensor([0]), torch.tensor([5]))


def test_take_along_dim_checks_its_indices():
    x = torch.randn(5, 3)
    wrapping = torch.tensor([[-1, 0, 4]])
    assert_close(kiln.ops.take_along_dim(x, wrapping, 0).torch(), torch.take_along_dim(x, wrapping, 0))
    with pytest.raises(IndexError, match="take_along_dim: index 5 is out of bounds"):
        kiln.ops.take_along_dim(x, torch.tensor([[5, 0, 0]]), 0)
    with pytest.raises(RuntimeError):
        torch.take_along_dim(x, torch.tensor([15]))
    with pytest.raises(RuntimeError, match="take_along_dim: index 15 is out of bounds"):
        kiln.ops.take_along_dim(x, torch.tensor([15]))


def test_kernel_errors_are_runtime_errors_of_the_kiln_family():
    with pytest.raises(KernelError):
        kiln.ops.embedding(torch.tensor([9]), torch.randn(3, 2))


def test_a_failed_check_in_an_unselected_branch_does_not_fire():
    """where(b != 0, a // b, 0) divides by zero only where eager does too (it computes a // b
    for every element first, so eager raises): Kiln matches. A guard inside one operator
    (pad, masks) never evaluates the other side's check."""
    x = torch.randn(4, 5)
    fn = _compiled(lambda x, i: torch.where(i >= 0, torch.index_select(x, 1, i.clamp(min=0)), 0.0))
    i = torch.tensor([0, -3, 4])
    assert_close(fn(x, i), torch.where(i >= 0, torch.index_select(x, 1, i.clamp(min=0)), 0.0))


def _run_on_the_gpu_in_a_child(code: str) -> tuple[int, str, str]:
    """(return code, stdout, stdout + stderr) of `code` run by a child Python: a device-side
    trap leaves the CUDA context unusable."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stdout + proc.stderr


@pytest.mark.cuda
def test_cuda_out_of_range_embedding_index_traps_instead_of_clamping():
    """A device-side trap, like PyTorch's device-side assertion: the next synchronizing call
    raises."""
    code = ("import torch, kiln\n"
            "w = torch.randn(5, 2, device='cuda')\n"
            "out = kiln.ops.embedding(torch.tensor([1, 1000], device='cuda'), w).torch()\n"
            "torch.cuda.synchronize()\n"
            "print('VALUE', out.tolist())\n")
    returncode, stdout, output = _run_on_the_gpu_in_a_child(code)
    assert returncode != 0 and "VALUE" not in stdout, stdout
    # the device's printf is flushed at best effort
    assert "embedding: index 1000 is out of range" in output or "CUDA error" in output, output


@pytest.mark.cuda
@pytest.mark.parametrize("call", [
    "scatter_add(x, 0, torch.tensor([[0, 1, 2, 0], [1, 1000, 0, 2]], device='cuda'), torch.randn(2, 4, device='cuda'))",
    "index_add(x, 0, torch.tensor([0, 1000], device='cuda'), torch.randn(2, 4, device='cuda'))",
    "index_put(x, [torch.tensor([0, 1000], device='cuda')], torch.randn(4, device='cuda'), True)",
    "scatter_reduce(x, 0, torch.tensor([[0, 1, 2, 0], [1, 1000, 0, 2]], device='cuda'), "
    "torch.randn(2, 4, device='cuda'), 'amax', False)",
])
def test_cuda_out_of_range_atomic_scatter_index_traps(call):
    """The atomic scatters (`scatter_atomic`) check every source's index as the gathering
    definitions do: an index out of range traps instead of writing out of bounds."""
    op = call.split("(")[0]
    code = ("import torch, kiln\n"
            "x = torch.randn(3, 4, device='cuda')\n"
            f"out = kiln.ops.{call}.torch()\n"
            "torch.cuda.synchronize()\n"
            "print('VALUE', out.tolist())\n")
    returncode, stdout, output = _run_on_the_gpu_in_a_child(code)
    assert returncode != 0 and "VALUE" not in stdout, stdout
    assert f"{op}: index 1000 is out of bounds for dimension 0 with size 3" in output or "CUDA error" in output, output


@pytest.mark.cuda
def test_cuda_in_range_and_wrapped_indices_match_eager():
    x = torch.randn(7, 9, device="cuda")
    i = torch.tensor([-1, 3, 0, -7], device="cuda")
    assert_close(_compiled(lambda x, i: x[i] * 2)(x, i), x[i] * 2)
    w = torch.randn(11, 4, device="cuda")
    ids = torch.randint(0, 11, (3, 5), device="cuda")
    assert_close(kiln.ops.embedding(ids, w).torch(), torch.nn.functional.embedding(ids, w))


@pytest.mark.parametrize("n", [12, 16, 33])
def test_a_load_under_a_condition_in_a_vectorized_loop(n):
    """A load in one branch of a select inside a short fixed-length loop (GCC 12.2 at -O3 with
    AVX2 vectorized it with masked loads reading the wrong elements: kiln.runtime.cpu.FLAGS)."""
    ops = kiln.ops
    x = kiln.symbol_like(kiln.from_torch(torch.randn(n, n)))
    keep = ops.gt(ops.abs(x), 0.3)
    shrunk = ops.where(ops.gt(ops.abs(x), 0.4), ops.sub(x, ops.mul(ops.sign(x), 0.4)), 0.0)
    graph = kiln.graph.optimize(kiln.trace_from([ops.where(keep, x, 0.0), shrunk], inputs=[x]))
    for _ in range(3):
        t = torch.randn(n, n)
        hard, soft = graph(kiln.from_torch(t))
        torch.testing.assert_close(hard.torch(), torch.nn.functional.hardshrink(t, 0.3))
        torch.testing.assert_close(soft.torch(), torch.nn.functional.softshrink(t, 0.4))
