"""The float32 SIMT GEMM template (`matmul_simt`) on a GPU against PyTorch in float64: every
knob setting of level 1 on the cases of `simt_cases` (tile edges, every operand layout,
batches with broadcasting, linear with bias, a convolution through the load hooks, fused
views), split-K over uneven k-tiles, and operands and outputs at addresses that are not 16-byte
aligned."""
from dataclasses import replace

import pytest
import torch

import kiln
from kiln.runtime.backend import backend_for
from kiln_ops_builtin.templates import matmul_simt

from tests.cuda.simt_cases import CALLS, VIEWS, call_inputs, call_task, view_task
from tests.support import assert_close, rand

pytestmark = pytest.mark.cuda

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _run(task, knobs, inputs, outputs=None):
    runner = backend_for(kiln.device("cuda")).load(matmul_simt.render(task, **knobs), kiln.device("cuda"))
    out = outputs if outputs is not None else torch.full(task.outputs[0].shape, float("nan"), device="cuda")
    runner(inputs, [out])
    return out


def _knob_id(knobs):
    return "-".join(f"{k}{v}" for k, v in knobs.items())


@pytest.mark.parametrize("knobs", matmul_simt.TEMPLATE.space(1), ids=_knob_id)
@pytest.mark.parametrize("name", list(CALLS))
def test_calls_match_torch(name, knobs):
    args = call_inputs(name, "cuda")
    task = call_task(name, args)
    want = CALLS[name][2](*[a.double() if isinstance(a, torch.Tensor) else a for a in args]).float()
    assert_close(_run(task, knobs, [a for a in args if isinstance(a, torch.Tensor)]), want, **TOL)


@pytest.mark.parametrize("knobs", matmul_simt.TEMPLATE.space(1), ids=_knob_id)
@pytest.mark.parametrize("name", list(VIEWS))
def test_fused_views_match_torch(name, knobs):
    shapes, _, reference = VIEWS[name]
    inputs = [rand(s, torch.float32).cuda() for s in shapes]
    task, positions = view_task(name)
    assert_close(_run(task, knobs, [inputs[i] for i in positions]), reference(*[t.double() for t in inputs]).float(),
                 **TOL)


@pytest.mark.parametrize("split", [2, 3, 7])
@pytest.mark.parametrize("shape", [(128, 200, 96), (33, 1000, 68)])
def test_split_k_matches_torch(shape, split):
    """Split-K over k-tiles that do not divide evenly (200 / 8 = 25 tiles, 1000 / 16), with a
    bias in the epilogue; four stages where a split has fewer k-tiles than the stages filled
    ahead (25 tiles over 7 splits: 4, and 1 in the last)."""
    m, k, n = shape
    args = [rand((m, k)).cuda(), rand((n, k)).cuda(), rand((n,)).cuda()]
    task = call_task("linear_bias", args)
    want = torch.nn.functional.linear(*[a.double() for a in args])
    eager_error = (torch.nn.functional.linear(*args).double() - want).abs().max().item()
    for knobs in (matmul_simt.WIDE, matmul_simt.TILE_64x64, replace(matmul_simt.WIDE, MIN_BLOCKS=2, STAGES=4, FRAG=1)):
        error = (_run(task, replace(knobs, SPLIT=split).as_dict(), args).double() - want).abs().max().item()
        assert error <= 4 * eager_error + 1e-5, (knobs, error, eager_error)   # sums of 1000 products


def test_misaligned_operands_and_output():
    """Operands and an output 4 bytes past a 16-byte boundary (the program's `alignment`): the
    runner stages them, the values stay right."""
    a_store, b_store, out_store = (torch.empty(n + 1, device="cuda") for n in (96 * 64, 64 * 120, 96 * 120))
    a, b = a_store[1:].view(96, 64), b_store[1:].view(64, 120)
    a.copy_(rand((96, 64))), b.copy_(rand((64, 120)))
    out = out_store[1:].view(96, 120)
    task = call_task("square_tiles", [a, b])
    for knobs in matmul_simt.TEMPLATE.space(1):
        out.fill_(float("nan"))
        _run(task, knobs, [a, b], out)
        assert_close(out, (a.double() @ b.double()).float(), **TOL)

