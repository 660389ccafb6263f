"""The skinny tensor-core matmul template (`gemv_tc`, 5 to 16 rows) on the GPU: every knob setting
of its level-2 space and its suggestions, float16 and bfloat16, odd N, K not a multiple of the
lanes' 32-element groups, leading dimensions, fused bias, against a float64 reference on fresh
random inputs, into NaN-poisoned outputs."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from tests.support import rand

pytestmark = pytest.mark.cuda

CALLS = {
    "m8_linear": ("linear", lambda dt: [rand((8, 776), dt), rand((1003, 776), dt), rand((1003,), dt)],
                  torch.nn.functional.linear),
    "m5_linear": ("linear", lambda dt: [rand((5, 4104), dt), rand((72, 4104), dt)], torch.nn.functional.linear),
    "m16_linear_3d": ("linear", lambda dt: [rand((2, 8, 1024), dt), rand((520, 1024), dt), rand((520,), dt)],
                      torch.nn.functional.linear),
}
DTYPES = (torch.float16, torch.bfloat16)


def _task(op, args):
    definition = registry().operator(op)
    return definition.task(definition.bind([kiln.from_torch(t) for t in args], {}))[0]


def _programs():
    from kiln_ops_builtin.templates import gemv_tc
    for call, (op, make, _) in CALLS.items():
        for dtype in DTYPES:
            task = _task(op, make(dtype))
            assert gemv_tc.applies(task), call
            settings = []
            for knobs in gemv_tc.TEMPLATE.space(2) + gemv_tc.suggest(task, 132)[:3]:
                if knobs not in settings:
                    settings.append(knobs)
            for knobs in settings:
                yield pytest.param(call, dtype, knobs,
                                   id=f"{call}-{str(dtype)[6:]}-{'-'.join(f'{k}{v}' for k, v in sorted(knobs.items()))}")


@pytest.mark.parametrize("call,dtype,knobs", list(_programs()))
def test_gemv_tc_matches_float64(call, dtype, knobs):
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import gemv_tc
    op, make, reference = CALLS[call]
    args = [t.cuda() for t in make(dtype)]
    task = _task(op, args)
    runner = backend_for(kiln.device("cuda")).load(gemv_tc.render(task, **knobs), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner(args, [out])
    torch.cuda.synchronize()
    expected = reference(*[t.double() for t in args])
    assert not out.isnan().any(), "some outputs were never written"
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def test_batched_decode_linear_of_a_compiled_model_runs_on_gemv_tc():
    """A linear layer over 8 rows compiled by the torch backend is scheduled on gemv_tc, and its
    error against float64 is no larger than eager's own (cuBLAS) beside it."""
    from kiln.schedule import schedules_for
    from kiln.runtime.cuda import arch_number, device_info
    layer = torch.nn.Linear(4096, 1100).to(torch.bfloat16).cuda()
    x = rand((8, 4096), torch.bfloat16).cuda()
    task = _task("linear", [x, layer.weight, layer.bias])
    assert schedules_for(task, "cuda", arch_number(device_info(0)["arch"]))[0].name == "gemv_tc"
    with torch.no_grad():
        out = torch.compile(layer, backend="kiln")(x)
        eager = layer(x)
        expected = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert (out.double() - expected).abs().max() <= 2 * (eager.double() - expected).abs().max()


@pytest.mark.parametrize("rows", [5, 12])
def test_batched_scores_of_a_compiled_function_match_float64(rows):
    """q @ k^T over heads (a batch dimension, k read through its transposed view) with 5 and 12
    query rows: within eager's own error against float64, doubled."""
    q, k = rand((3, rows, 264), torch.float16).cuda(), rand((3, 77, 264), torch.float16).cuda()
    out = torch.compile(lambda q, k: q @ k.transpose(-1, -2), backend="kiln")(q, k)
    expected = q.double() @ k.double().transpose(-1, -2)
    eager = q @ k.transpose(-1, -2)
    assert (out.double() - expected).abs().max() <= 2 * (eager.double() - expected).abs().max() + 1e-3
