"""Tensors with a zero-size dimension through torch.compile(backend="kiln"), as OpInfo's empty
samples: eager's (empty) results on the CPU and, marked `cuda`, on a GPU.

CUDA rejects a launch of no blocks, and a node with no elements has a CUDA program with no
launch at all (the auto-scheduler writes no kernel for an empty buffer) or launches over no
items: the runtime makes no launch that has no work (`kiln.runtime.cuda.Launch.empty`) and
loads nothing for a program left with none; a graph whose nodes all have no elements captures
no (empty) CUDA graph. Without a GPU, the CUDA runner is checked on the programs these graphs'
nodes get, with the device, NVRTC and the driver stood in for."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from kiln.runtime import cuda as rt
from kiln.schedule import choose

from tests.frontend.frontend_support import Capture, compile_and_compare


def _sorted(*shape):
    return torch.sort(torch.randn(*shape)).values


CASES = {
    "exp": (torch.exp, lambda: [torch.randn(0, 3)]),
    "log": (torch.log, lambda: [torch.rand(2, 0) + 1]),
    "sigmoid": (torch.sigmoid, lambda: [torch.randn(0)]),
    "roll": (lambda x: torch.roll(x, 1, 0), lambda: [torch.randn(0, 4)]),
    "repeat": (lambda x: x.repeat(2, 3), lambda: [torch.randn(0, 4)]),
    "unfold": (lambda x: x.unfold(1, 2, 1), lambda: [torch.randn(0, 5)]),
    "searchsorted": (torch.searchsorted, lambda: [_sorted(3, 5), torch.randn(3, 0)]),
    "new_zeros": (lambda x: x.new_zeros((0, 3)) + x.sum(), lambda: [torch.randn(2, 3)]),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), lambda: [torch.randn(0, 8, 3, 3)]),
    "sum_of_empty_rows": (lambda x: x.sum(1) + 1, lambda: [torch.randn(3, 0)]),
    "one_output_empty": (lambda x: (x.exp(), x.sum(1)), lambda: [torch.randn(3, 0)]),
}


def test_a_launch_without_work_is_empty():
    launch = rt.Launch("k", (), (128, 1, 1), grid=(4, 0, 1))
    assert launch.empty and rt.Launch("k", (), (128, 1, 1), grid=(0, 1, 1)).empty
    assert not rt.Launch("k", (), (128, 1, 1), grid=(4, 2, 1)).empty
    assert rt.Launch("k", (), (128, 1, 1), items=0).empty and not rt.Launch("k", (), (128, 1, 1), items=1).empty


@pytest.fixture
def no_gpu_runner(monkeypatch):
    """CudaRunner with a stand-in device, compiler and kernels: what it compiles and loads."""
    compiled, loaded = [], []

    class Kernel:
        def __init__(self, cubin, name, *args):
            loaded.append(name)

    monkeypatch.setattr(rt, "device_info", lambda index: {"sm_count": 132, "arch": "sm_90", "name": "stand-in"})
    monkeypatch.setattr(rt, "compile_cubin", lambda source, name, arch: compiled.append(name) or "cubin")
    monkeypatch.setattr(rt, "CudaKernel", Kernel)
    return compiled, loaded


def test_runner_makes_only_launches_with_work(no_gpu_runner):
    compiled, loaded = no_gpu_runner
    block = (128, 1, 1)
    program = rt.CudaProgram("", [rt.Launch("a", (), block, grid=(3, 0, 1)), rt.Launch("b", (), block, items=5),
                                  rt.Launch("c", (), block, items=0)])
    runner = rt.CudaRunner(program, 0)
    assert [launch.kernel for launch in runner.launches] == ["b"] and loaded == ["b"]
    assert runner.shapes == [((5, 1, 1), block)]
    nothing = rt.CudaRunner(rt.CudaProgram("", [rt.Launch("a", (), block, items=0)]), 0)
    assert nothing.launches == [] and compiled == ["b"], "a program with no work compiles nothing"
    nothing([], [])       # and runs nothing, touching no device


@pytest.mark.parametrize("name", CASES)
def test_empty_samples_match_eager_and_their_cuda_programs_load(name, no_gpu_runner):
    fn, make = CASES[name]
    capture, _ = compile_and_compare(fn, *make())
    (run,) = capture.compiled[0].graphs.values()
    for node in run.graph.nodes:
        program = choose(node.task, "cuda")
        runner = rt.CudaRunner(program, 0)
        assert runner.launches == [launch for launch in program.launches if not launch.empty]


@pytest.mark.cuda
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_empty_samples_match_eager_on_cuda(name, cuda_graphs):
    fn, make = CASES[name]
    inputs = [t.cuda() for t in make()]
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="The CUDA Graph is empty")   # nothing to capture
        expected = fn(*inputs)
        actual = torch.compile(fn, backend=Capture(use_cuda_graph=cuda_graphs), fullgraph=True)(*inputs)
    torch.testing.assert_close(actual, expected)
