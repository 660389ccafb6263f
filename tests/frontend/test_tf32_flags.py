"""torch's TF32 flags in the torch backend (`kiln.frontend.torch.config.FROM_TORCH`): both are
copied into the settings of a compile unless its options set them; cuDNN's, which dynamo does
not guard, is read again at each call by a compiled graph whose plans depend on it (and by no
other), which then runs the plan made for the flag's value, compiling it once. Without a GPU:
the decisions, on a stand-in for the compiled run, and a CPU graph end to end."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kiln.frontend.torch.backend import KilnFunction, kiln_backend
from kiln.frontend.torch.config import FROM_TORCH, UNGUARDED, dynamo_config
from tests.support import cudnn_tf32


@pytest.fixture
def flags():
    previous = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def test_both_flags_are_copied_unless_the_options_set_them(flags):
    for value in (True, False):
        torch.backends.cuda.matmul.allow_tf32 = not value
        with cudnn_tf32(value):
            settings = dynamo_config.resolve()
            assert (settings.allow_tf32_convolution, settings.allow_tf32) == (value, not value)
            assert dynamo_config.resolve({"allow_tf32_convolution": not value}).allow_tf32_convolution is (not value)
    assert set(FROM_TORCH) == {"allow_tf32", "allow_tf32_convolution"} and UNGUARDED == ("allow_tf32_convolution",)


def test_only_the_unguarded_flag_not_set_by_options_is_followed():
    assert list(dynamo_config.followed()) == ["allow_tf32_convolution"]     # dynamo guards the matmul flag
    assert dynamo_config.followed({"allow_tf32_convolution": True}) == {}
    assert list(dynamo_config.followed({"allow_tf32": True, "mode": "default"})) == ["allow_tf32_convolution"]


class _Run:
    """A stand-in CompiledRun: its plan depends on the settings `permissions`; a call returns
    the cuDNN permission it was compiled under."""

    def __init__(self, settings, permissions):
        self.record = SimpleNamespace(permissions=permissions)
        self.value = settings.allow_tf32_convolution

    def __call__(self, args):
        return self.value


def _function(permissions):
    """A KilnFunction following a stand-in flag, compiling stand-in runs; the flag, the list of
    its reads and the list of compiles (the permission each ran under)."""
    flag, reads, compiles = {"value": True}, [], []

    def read():
        reads.append(flag["value"])
        return flag["value"]

    fn = KilnFunction(torch.fx.symbolic_trace(lambda x: x + 1), dynamo_config.resolve(),
                      followed={"allow_tf32_convolution": read})

    def compile(args):
        settings = fn.settings_now()
        compiles.append(settings.allow_tf32_convolution)
        return _Run(settings, permissions)

    fn._compile = compile
    return fn, flag, reads, compiles


def test_a_graph_depending_on_the_flag_runs_the_plan_for_its_value_now():
    fn, flag, reads, compiles = _function(("allow_tf32", "allow_tf32_convolution"))
    x = torch.ones(3)
    assert fn(x) is True and fn(x) is True and compiles == [True]
    assert fn.follows == ("allow_tf32_convolution",)
    flag["value"] = False
    assert fn(x) is False and fn(x) is False and compiles == [True, False]    # compiled once for the change
    flag["value"] = True
    assert fn(x) is True and compiles == [True, False]                        # both plans kept
    assert fn(torch.ones(4)) is True and compiles == [True, False, True]      # a new signature


def test_a_graph_not_depending_on_it_never_reads_it_after_compiling():
    fn, flag, reads, compiles = _function(("allow_tf32",))
    x = torch.ones(3)
    assert fn(x) is True and compiles == [True] and fn.follows == ()
    read_at_compile = len(reads)
    flag["value"] = False
    for _ in range(3):
        assert fn(x) is True
    assert compiles == [True] and len(reads) == read_at_compile


def test_a_cpu_convolution_depends_on_no_flag(flags):
    class Conv(torch.nn.Module):
        def forward(self, x, w):
            return F.conv2d(x, w, padding=1)

    x, w = torch.randn(1, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with cudnn_tf32(True):
        fn = kiln_backend(torch.fx.symbolic_trace(Conv()), [x, w])
        torch.testing.assert_close(fn(x, w), F.conv2d(x, w, padding=1), rtol=1e-5, atol=1e-5)
    (run,) = fn.graphs.values()
    assert run.record.permissions == () and fn.follows == () and "allow_tf32_convolution" in fn.followed


def test_the_tests_set_cudnns_flag_after_pytorchs_test_modules_froze_the_flags():
    """Before: the suite's fixture set `torch.backends.cudnn.allow_tf32` directly, which raises in
    every test once the OpInfo test has imported PyTorch's test modules (they call
    `torch.backends.disable_global_flags()`): 4,212 errors in a whole run. `cudnn_tf32` goes
    through `cudnn.flags`, which is allowed then."""
    torch.backends.disable_global_flags()       # as importing torch.testing._internal does
    for value in (True, False):
        with cudnn_tf32(value):
            assert torch.backends.cudnn.allow_tf32 is value
            assert dynamo_config.resolve().allow_tf32_convolution is value


def test_no_test_sets_cudnns_flags_with_monkeypatch():
    """Before: the float32 model-class test set cuDNN's TF32 flag with `monkeypatch.setattr`,
    which raises once the flags are frozen (above): all 22 of its cases failed in a whole
    `-m cuda` run and passed alone. cuDNN's flags go through `cudnn_tf32` (or the autouse
    fixture)."""
    from pathlib import Path
    tests = Path(__file__).resolve().parents[1]
    setters = [str(path.relative_to(tests)) for path in tests.rglob("*.py")
               if "setattr(torch.backends.cudnn," in path.read_text() and path != Path(__file__).resolve()]
    assert setters == []
