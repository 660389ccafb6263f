"""Shared pytest configuration: tests marked `slow` run first, tests marked `cuda` skip on
machines without a usable GPU, and the whole-graph cache is off (KILN_GRAPH_CACHE=0, for the
subprocesses tests start too): a test compiles what it means to compile, whatever an earlier
test or run left on disk. The graph cache's own tests turn it on over a cache of their own.
cuDNN's TF32 flag is off in each test (`float32_convolutions`)."""
import os

import pytest
import torch

os.environ["KILN_GRAPH_CACHE"] = "0"

from tests.support import cudnn_tf32  # noqa: E402  (after the variable: it imports kiln)


def pytest_collection_modifyitems(config, items):
    # Long tests first (a stable sort keeps the order otherwise): the test workers take them
    # while the short tests fill in around them, rather than one worker ending the run alone
    # on a long test that it took last.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """dynamo's compiled frames and Kiln's dynamo_config reset around a test (a file takes it
    for every test with `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    import kiln
    torch._dynamo.reset()
    yield
    kiln.torch.dynamo_config.reset()
    torch._dynamo.reset()


@pytest.fixture
def no_nvrtc_check(monkeypatch):
    """No NVRTC check of the CUDA programs of CPU builds: it renders every template at every
    knob of level 1, whose choices compare sizes too (guards that hold in fewer sizes), so a
    test of which sizes a plan serves takes it (with `usefixtures`)."""
    monkeypatch.delenv("KILN_NVRTC_CHECK", raising=False)


@pytest.fixture
def traced(monkeypatch):
    """The sizes (the graph's symbolic input sizes, by name; empty for fixed sizes) of each
    trace Kiln's torch backend makes during the test: a plan reused makes none."""
    from kiln.frontend.torch.backend import KilnFunction
    from kiln.frontend.torch.plan_reuse import size_values
    sizes = []
    trace = KilnFunction._trace

    def counted(self, args, input_sizes, *rest):
        sizes.append(size_values(input_sizes))
        return trace(self, args, input_sizes, *rest)
    monkeypatch.setattr(KilnFunction, "_trace", counted)
    return sizes


@pytest.fixture(autouse=True)
def float32_convolutions():
    """cuDNN's TF32 flag (`torch.backends.cudnn.allow_tf32`, True by default) off around each
    test, as torch's matmul flag is by default: float32 convolutions on a GPU, eager's and
    Kiln's (which follows the flag), compute in float32, as the tests' tolerances against eager
    assume. The tests of TF32 (tests/cuda/test_conv_tf32_cuda.py) set it themselves."""
    with cudnn_tf32(False):
        yield
