"""The decode-shaped matmul template (`gemv`, M <= 4) on the GPU: every knob setting of its
level-1 and level-2 spaces and its suggestions, float16, bfloat16 and float32, odd N, K not a
multiple of the warps' stride, batch dimensions, fused bias, against a float64 reference
on fresh random inputs, into NaN-poisoned outputs."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from tests.support import rand

pytestmark = pytest.mark.cuda

CALLS = {
    "decode_linear": ("linear", lambda dt: [rand((1, 776), dt), rand((1003, 776), dt), rand((1003,), dt)],
                      torch.nn.functional.linear),
    "m3_linear": ("linear", lambda dt: [rand((3, 4104), dt), rand((72, 4104), dt)], torch.nn.functional.linear),
    "m4_linear_3d": ("linear", lambda dt: [rand((2, 2, 1024), dt), rand((520, 1024), dt), rand((520,), dt)],
                     torch.nn.functional.linear),
    "m1_linear_batched": ("linear", lambda dt: [rand((3, 1, 264), dt), rand((77, 264), dt)],
                          torch.nn.functional.linear),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _task(op, args):
    definition = registry().operator(op)
    return definition.task(definition.bind([kiln.from_torch(t) for t in args], {}))[0]


def _programs():
    from kiln_ops_builtin.templates import gemv
    for call, (op, make, _) in CALLS.items():
        for dtype in DTYPES:
            task = _task(op, make(dtype))
            assert gemv.applies(task), call
            settings = []
            for knobs in gemv.TEMPLATE.space(2) + gemv.suggest(task, 132)[:3]:
                if knobs not in settings:
                    settings.append(knobs)
            for knobs in settings:
                yield pytest.param(call, dtype, knobs,
                                   id=f"{call}-{str(dtype)[6:]}-{'-'.join(f'{k}{v}' for k, v in sorted(knobs.items()))}")


@pytest.mark.parametrize("call,dtype,knobs", list(_programs()))
def test_gemv_matches_float64(call, dtype, knobs):
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import gemv
    op, make, reference = CALLS[call]
    args = [t.cuda() for t in make(dtype)]
    task = _task(op, args)
    runner = backend_for(kiln.device("cuda")).load(gemv.render(task, **knobs), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner(args, [out])
    torch.cuda.synchronize()
    expected = reference(*[t.double() for t in args])
    assert not out.isnan().any(), "some outputs were never written"
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def test_decode_linear_of_a_compiled_model_runs_on_gemv():
    """A batch-1 linear layer compiled by the torch backend is scheduled on the gemv template."""
    from kiln.schedule import schedules_for
    from kiln.runtime.cuda import arch_number, device_info
    layer = torch.nn.Linear(4096, 1100).half().cuda()
    x = rand((1, 4096), torch.float16).cuda()
    task = _task("linear", [x, layer.weight, layer.bias])
    assert schedules_for(task, "cuda", arch_number(device_info(0)["arch"]))[0].name == "gemv"
    with torch.no_grad():
        out = torch.compile(layer, backend="kiln")(x)
        expected = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-2 * expected.abs().max().item(), rtol=1e-2)
