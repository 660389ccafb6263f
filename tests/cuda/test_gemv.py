"""The decode-shaped matmul templates on the GPU, `gemv` (M <= 4) and `gemv_tc` (5 to 16 rows on
the tensor cores): every knob setting of their level-1 and level-2 spaces and their suggestions,
each dtype they take, odd N, K not a multiple of the warps' stride (or of gemv_tc's 32-element
groups), batch and leading dimensions, fused bias, against a float64 reference on fresh random
inputs, into NaN-poisoned outputs; split-K in a thread-block cluster (sm_90) with a bias and a
residual fused, against float64 and bit for bit against the same split through the sum kernel."""
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
    if knobs.get("CLUSTER"):
        _needs_sm90()
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


# ---------------------------------------------------------------- split-K in a thread-block cluster (sm_90)

def _needs_sm90():
    from kiln.runtime.cuda import arch_number, device_info
    if arch_number(device_info(0)["arch"]) < 90:
        pytest.skip("thread-block clusters need sm_90")


def _fused(build, shapes, dtype):
    """The one fused task that optimizing `build(*symbols)` leaves, each operand a symbol."""
    from kiln.graph import optimize
    symbols = [kiln.symbol(shape, str(dtype)[6:], "cuda") for shape in shapes]
    (node,) = optimize(kiln.trace_from(build(*symbols), symbols)).nodes
    return node.task


EPILOGUES = {
    "plain": (lambda x, w: kiln.ops.linear(x, w), lambda m, n: []),
    "bias": (lambda x, w, b: kiln.ops.linear(x, w, b), lambda m, n: [(n,)]),
    "bias_residual": (lambda x, w, b, r: kiln.ops.add(kiln.ops.linear(x, w, b), r), lambda m, n: [(n,), (m, n)]),
}
# rows M (gemv up to 4, gemv_tc 5 to 16), K (whole 16-byte vectors, not whole steps or groups), odd N
SHAPES = [(1, 4104, 1003), (2, 8200, 129), (4, 2056, 77), (5, 4104, 777), (8, 2056, 1003), (12, 1032, 129),
          (16, 8200, 77)]


def _cluster_settings(module, task):
    """The CLUSTER settings of `module`'s level-2 space that split K (a three-way split, and
    sixteen-warp blocks for gemv_tc, added), and its suggestion for `task` in a cluster."""
    settings = [k for k in module.TEMPLATE.space(2) if k["CLUSTER"]]
    settings += [dict(settings[-1], SPLIT=3)]
    if module.TEMPLATE.name == "gemv_tc":
        settings += [dict(settings[-1], KW=16, WARPS=16, SPLIT=8)]
    settings += [k for k in module.suggest(task, 132)[:1] if k["CLUSTER"] and k not in settings]
    return settings


def _operands(task, shapes, dtype):
    """Random operands of `shapes` (each case's differ), and the same in the order of `task`'s
    inputs."""
    values = {shape: rand(shape, dtype).cuda() for shape in shapes}
    return [values[shape] for shape in shapes], [values[tuple(t.shape)] for t in task.inputs]


def _launch(render, task, knobs, args, dtype):
    from kiln.runtime.backend import backend_for
    runner = backend_for(kiln.device("cuda")).load(render(task, **knobs), kiln.device("cuda"))
    out = torch.full(tuple(task.outputs[0].shape), float("nan"), dtype=dtype, device="cuda")
    runner(args, [out])
    torch.cuda.synchronize()
    assert not out.isnan().any(), "some outputs were never written"
    return out


def _close(out, expected, dtype):
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_cluster_split_matches_float64_and_the_sum_kernel(m, k, n, epilogue, dtype):
    """Split-K in a cluster (every CLUSTER setting, odd N, K not whole steps, a bias and a residual
    fused) against float64; and bit for bit what the same split through the workspace and the sum
    kernel gives: the partials are added in the same order."""
    from kiln_ops_builtin.templates import gemv, gemv_tc
    _needs_sm90()
    module = gemv if m <= gemv.MAX_M else gemv_tc
    build, extra = EPILOGUES[epilogue]
    shapes = [(m, k), (n, k), *extra(m, n)]
    task = _fused(build, shapes, dtype)
    assert module.applies(task)
    (x, w, *rest), args = _operands(task, shapes, dtype)
    expected = x.double() @ w.double().T + sum(t.double() for t in rest)
    for knobs in _cluster_settings(module, task):
        program = module.render(task, **knobs)
        assert [l.kernel for l in program.launches] == [program.launches[0].kernel] and program.launches[0].cluster > 1
        out = _launch(module.render, task, knobs, args, dtype)
        _close(out, expected, dtype)
        assert torch.equal(out, _launch(module.render, task, dict(knobs, CLUSTER=False), args, dtype)), knobs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m", [3, 8])
def test_cluster_split_of_a_batched_product_matches_float64(m, dtype):
    """q @ k^T over a batch of heads (the grid's z; k read through its transposed view), split in
    clusters."""
    from kiln_ops_builtin.templates import gemv, gemv_tc
    _needs_sm90()
    module = gemv if m <= gemv.MAX_M else gemv_tc
    shapes = [(3, m, 2056), (3, 77, 2056)]
    task = _fused(lambda q, kk: kiln.ops.matmul(q, kiln.ops.transpose(kk, 1, 2)), shapes, dtype)
    (q, kk), args = _operands(task, shapes, dtype)
    expected = q.double() @ kk.double().transpose(1, 2)
    for knobs in _cluster_settings(module, task):
        _close(_launch(module.render, task, knobs, args, dtype), expected, dtype)


def test_decode_down_projection_at_batch_8_is_one_launch_on_sm90():
    """The Llama-shaped down projection with its residual at batch 8 (split in two on 132 SMs):
    one cluster launch where the GPU has clusters, within eager's own error against float64,
    doubled."""
    from kiln.runtime.cuda import arch_number, device_info
    from kiln.schedule import choose
    _needs_sm90()
    layer = torch.nn.Linear(5632, 2048, bias=False).to(torch.bfloat16).cuda()
    x, r = rand((8, 5632), torch.bfloat16).cuda(), rand((8, 2048), torch.bfloat16).cuda()
    task = _fused(lambda x, w, r: kiln.ops.add(kiln.ops.linear(x, w), r), [(8, 5632), (2048, 5632), (8, 2048)],
                  torch.bfloat16)
    program = choose(task, "cuda", arch_number(device_info(0)["arch"]))
    assert [l.kernel for l in program.launches] == ["kiln_gemv_tc"] and program.launches[0].cluster > 1
    with torch.no_grad():
        out = torch.compile(lambda x, r: layer(x) + r, backend="kiln")(x, r)
        eager = layer(x) + r
        expected = x.double() @ layer.weight.double().T + r.double()
    assert (out.double() - expected).abs().max() <= 2 * (eager.double() - expected).abs().max()
