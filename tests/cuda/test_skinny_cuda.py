"""Skinny matmuls on a GPU against PyTorch: small tiles and split-K chosen by the templates'
cost model (tuning level 0), BERT/GPT-2-like shapes at batch 1, odd sizes, a fused bias + gelu
epilogue, batched attention-like products, and every template's split-K suggestions."""
import math

import pytest
import torch

import kiln
from kiln.plugins.registry import registry

pytestmark = pytest.mark.cuda

ops = kiln.ops
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _check(actual, expected, dtype):
    """`actual` (Kiln, `dtype`) against a float64 `expected`: relative to the output's scale,
    elementwise and in norm."""
    got = (actual.torch() if isinstance(actual, kiln.Tensor) else actual)
    assert got.dtype == dtype and got.shape == expected.shape
    err = (got.double() - expected).abs()
    scale = expected.abs().max().clamp_min(1e-6)
    assert torch.isfinite(got.double()).all()
    assert err.max() <= 4 * TOL[dtype] * scale, f"max error {err.max():.3g} vs scale {scale:.3g}"
    assert err.norm() <= TOL[dtype] * expected.norm(), f"relative norm error {err.norm() / expected.norm():.3g}"


def _rand(*shape, dtype):
    return (torch.rand(shape, device="cuda", dtype=torch.float32) * 2 - 1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("n", [768, 3072, 50])
@pytest.mark.parametrize("k", [768, 3072, 1000])
@pytest.mark.parametrize("m", [1, 17, 128])
def test_linear_skinny(m, k, n, dtype):
    x, w, b = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype), _rand(n, dtype=dtype)
    _check(ops.linear(x, w, b), x.double() @ w.double().T + b.double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m,k,n", [(17, 1000, 50), (128, 768, 768), (128, 3072, 768), (33, 520, 33), (5, 64, 7)])
def test_matmul_row_major_weight(m, k, n, dtype):
    """B as a row-major [K, N] (wgmma's transposed path), odd sizes."""
    a, b = _rand(m, k, dtype=dtype), _rand(k, n, dtype=dtype)
    _check(ops.matmul(a, b), a.double() @ b.double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_attention_like_batched(dtype):
    """Per-head products of BERT at 128 tokens: scores q @ k^T and the weighted values."""
    q, kt, v = _rand(12, 128, 64, dtype=dtype), _rand(12, 64, 128, dtype=dtype), _rand(12, 128, 64, dtype=dtype)
    _check(ops.matmul(q, kt), q.double() @ kt.double(), dtype)
    p = _rand(12, 128, 128, dtype=dtype)
    _check(ops.matmul(p, v), p.double() @ v.double(), dtype)
    q1 = _rand(1, 12, 17, 64, dtype=dtype)                 # odd sequence length, broadcast batch
    _check(ops.matmul(q1, kt), q1.double() @ kt.double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("m,k,n", [(17, 1000, 50), (128, 3072, 768), (128, 768, 3072)])
def test_fused_bias_gelu_epilogue(m, k, n, dtype):
    """kiln.graph.optimize puts bias + gelu into the template's epilogue, which split-K applies
    in its sum kernel."""
    name = str(dtype)[6:]
    xs, ws, bs = (kiln.symbol(s, name, "cuda") for s in ([m, k], [k, n], [n]))
    opt = kiln.graph.optimize(kiln.trace_from(ops.gelu(ops.add(ops.matmul(xs, ws), bs)), [xs, ws, bs]))
    assert len(opt.nodes) == 1
    x, w, b = _rand(m, k, dtype=dtype), _rand(k, n, dtype=dtype), _rand(n, dtype=dtype)
    h = x.double() @ w.double() + b.double()
    expected = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    _check(opt(x, w, b), expected, dtype)


def _every_template_suggestion():
    """(template, knobs) of each applicable template's first suggestion and first split-K one."""
    from kiln.schedule import schedules_for
    calls = [((17, 1000), (1000, 50)), ((128, 3072), (3072, 768)), ((2, 3, 40, 192), (3, 192, 33))]
    for dtype in DTYPES:
        for shapes in calls:
            definition = registry().operator("matmul")
            zeros = [kiln.from_torch(torch.zeros(s, dtype=dtype)) for s in shapes]
            task = definition.task(definition.bind(zeros, {}))[0]
            for template in schedules_for(task, "cuda"):
                ranked = template.suggest(task, 132)          # an H100/H200's SMs
                picked = ranked[:1] + [k for k in ranked if k.get("SPLIT", 1) > 1][:2]
                for knobs in [k for i, k in enumerate(picked) if k not in picked[:i]]:
                    yield pytest.param(shapes, dtype, template, knobs,
                                       id=f"{template.name}-{'x'.join(map(str, shapes[0] + shapes[1]))}-"
                                          f"{str(dtype)[6:]}-{'-'.join(map(str, knobs.values()))}")


@pytest.mark.parametrize("shapes,dtype,template,knobs", list(_every_template_suggestion()))
def test_every_template_split_k(shapes, dtype, template, knobs):
    """Each template's suggestions (matmul_tc too, which sm_90 would not pick) on the GPU."""
    from kiln.runtime.cuda import arch_number, device_info
    from kiln.runtime.backend import backend_for
    if template.min_arch > arch_number(device_info(0)["arch"]):
        pytest.skip(f"{template.name} needs sm_{template.min_arch}")
    a, b = (_rand(*s, dtype=dtype) for s in shapes)
    definition = registry().operator("matmul")
    task = definition.task(definition.bind([kiln.from_torch(a), kiln.from_torch(b)], {}))[0]
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    backend_for(kiln.device("cuda")).load(template.render(task, **knobs), kiln.device("cuda"))([a, b], [out])
    _check(out, a.double() @ b.double(), dtype)
