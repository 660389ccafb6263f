"""The decode-shaped matmul templates on the GPU, `gemv` (M <= 4) and `gemv_tc` (5 to 16 rows on
the tensor cores): every knob setting of their level-1 and level-2 spaces and their suggestions,
each dtype they take, odd N, K not a multiple of the warps' stride (or of gemv_tc's 32-element
groups), batch and leading dimensions, fused bias, against a float64 reference on fresh random
inputs, into NaN-poisoned outputs."""
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
CALLS_TC = {
    "m8_linear": ("linear", lambda dt: [rand((8, 776), dt), rand((1003, 776), dt), rand((1003,), dt)],
                  torch.nn.functional.linear),
    "m5_linear": ("linear", lambda dt: [rand((5, 4104), dt), rand((72, 4104), dt)], torch.nn.functional.linear),
    "m16_linear_3d": ("linear", lambda dt: [rand((2, 8, 1024), dt), rand((520, 1024), dt), rand((520,), dt)],
                      torch.nn.functional.linear),
}
TEMPLATES = {"gemv": (CALLS, (torch.float16, torch.bfloat16, torch.float32)),
             "gemv_tc": (CALLS_TC, (torch.float16, torch.bfloat16))}


def _task(op, args):
    definition = registry().operator(op)
    return definition.task(definition.bind([kiln.from_torch(t) for t in args], {}))[0]


def _programs():
    from kiln_ops_builtin.templates import gemv, gemv_tc
    for module in (gemv, gemv_tc):
        name = module.TEMPLATE.name
        calls, dtypes = TEMPLATES[name]
        for call, (op, make, _) in calls.items():
            for dtype in dtypes:
                task = _task(op, make(dtype))
                assert module.applies(task), call
                settings = []
                for knobs in module.TEMPLATE.space(2) + module.suggest(task, 132)[:3]:
                    if knobs not in settings:
                        settings.append(knobs)
                for knobs in settings:
                    yield pytest.param(name, call, dtype, knobs, id=f"{name}-{call}-{str(dtype)[6:]}-"
                                       + "-".join(f"{k}{v}" for k, v in sorted(knobs.items())))


@pytest.mark.parametrize("template,call,dtype,knobs", list(_programs()))
def test_matches_float64(template, call, dtype, knobs):
    from kiln.runtime.backend import backend_for
    from kiln.schedule.choose import templates_for
    render = next(t for t in templates_for("linear", "cuda") if t.name == template).render
    op, make, reference = TEMPLATES[template][0][call]
    args = [t.cuda() for t in make(dtype)]
    task = _task(op, args)
    runner = backend_for(kiln.device("cuda")).load(render(task, **knobs), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner(args, [out])
    torch.cuda.synchronize()
    expected = reference(*[t.double() for t in args])
    assert not out.isnan().any(), "some outputs were never written"
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("rows,template", [(1, "gemv"), (8, "gemv_tc")])
def test_decode_linear_of_a_compiled_model_runs_on_its_template(rows, template):
    """A linear layer over 1 or 8 rows compiled by the torch backend is scheduled on gemv or
    gemv_tc, and its error against float64 is no larger than eager's own (cuBLAS) beside it, doubled."""
    from kiln.schedule import schedules_for
    from kiln.runtime.cuda import arch_number, device_info
    layer = torch.nn.Linear(4096, 1100).to(torch.bfloat16).cuda()
    x = rand((rows, 4096), torch.bfloat16).cuda()
    task = _task("linear", [x, layer.weight, layer.bias])
    assert schedules_for(task, "cuda", arch_number(device_info(0)["arch"]))[0].name == template
    with torch.no_grad():
        out = torch.compile(layer, backend="kiln")(x)
        eager = layer(x)
        expected = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert (out.double() - expected).abs().max() <= 2 * (eager.double() - expected).abs().max()


@pytest.mark.parametrize("rows", [5, 12])
def test_batched_scores_of_a_compiled_function_match_float64(rows):
    """q @ k^T over heads (a batch dimension, k read through its transposed view) with 5 and 12
    query rows (gemv_tc's): within eager's own error against float64, doubled."""
    q, k = rand((3, rows, 264), torch.float16).cuda(), rand((3, 77, 264), torch.float16).cuda()
    out = torch.compile(lambda q, k: q @ k.transpose(-1, -2), backend="kiln")(q, k)
    expected = q.double() @ k.double().transpose(-1, -2)
    eager = q @ k.transpose(-1, -2)
    assert (out.double() - expected).abs().max() <= 2 * (eager.double() - expected).abs().max() + 1e-3
