"""Epilogue sources: what a GEMM or convolution epilogue reads per output element at
m * row_stride + n (a residual add) is found by the core (`kiln.codegen.epilogue.contraction_epilogue`)
and staged by the Hopper engine as tiles in shared memory, copied by TMA ahead of the epilogue
(`sm90_engine`: two buffers, the ring made shallower where shared memory needs it).

Without a GPU: which reads are sources and which are not (a bias, a transposed or
per-row read), the engine's choice to stage or not, and NVRTC compilation of every knob
setting with sources. With a GPU (`cuda` marker): every knob setting with one and two sources,
rows not a multiple of any tile, and the fallback where a source's rows are not 16-byte
aligned, against float64 into NaN-poisoned outputs."""
import pytest
import torch

import kiln
from kiln.graph import optimize
from kiln.runtime import cuda as rt
from tests.cuda.conv_support import reference as conv_reference
from tests.support import rand

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
ops = kiln.ops


def _fused_task(build, shapes, dtype="float16"):
    """The task of the one fused node that optimizing `build(*symbols)` leaves, every operand a
    symbol (its inputs in0, in1, .. in the order of `shapes`)."""
    symbols = [kiln.symbol(shape, dtype, "cuda") for shape in shapes]
    (node,) = optimize(kiln.trace_from(build(*symbols), symbols)).nodes
    assert [tuple(t.shape) for t in node.task.inputs] == [tuple(s) for s in shapes]
    return node.task


def _linear_residual(m, k, n, residuals=1, dtype="float16"):
    """relu(x @ w.T + b + r0 (+ r1)) on x: [m, k], w: [n, k], b: [n], r: [m, n]."""
    def build(x, w, b, *rs):
        y = ops.linear(x, w, b)
        for r in rs:
            y = ops.add(y, r)
        return ops.relu(y)
    return _fused_task(build, [(m, k), (n, k), (n,)] + [(m, n)] * residuals, dtype)


def _sources(task):
    from kiln.codegen.hooks import match_contraction, match_hooked_gemm
    found = match_contraction(task) or match_hooked_gemm(task)
    return found.sources


def test_a_residual_is_a_source_and_a_bias_is_not():
    (source,) = _sources(_linear_residual(300, 64, 136))
    assert source.row_stride == 136 and source.dtype == kiln.dtypes.float16 and source.param == "in3"
    assert [s.param for s in _sources(_linear_residual(300, 64, 136, residuals=2))] == ["in3", "in4"]
    bias_only = _fused_task(lambda x, w, b: ops.relu(ops.linear(x, w, b)), [(300, 64), (136, 64), (136,)])
    assert _sources(bias_only) == ()
    (source,) = _sources(_conv_residual_task())
    assert source.row_stride == 72 and source.param == "in2"


def test_reads_that_are_not_row_major_tiles_are_not_sources():
    """A residual read transposed, or broadcast along n (one value per row), stays a global load."""
    transposed = _fused_task(lambda x, w, r: ops.add(ops.linear(x, w), ops.permute(r, (1, 0))),
                             [(300, 64), (136, 64), (136, 300)])
    per_row = _fused_task(lambda x, w, r: ops.mul(ops.linear(x, w), r), [(300, 64), (136, 64), (300, 1)])
    assert _sources(transposed) == () and _sources(per_row) == ()


def test_staging_fits_shared_memory_or_stays_off():
    from dataclasses import replace

    from kiln_ops_builtin.templates import gemm_sm90, sm90_engine
    sources = _sources(_linear_residual(300, 64, 136))
    ping_pong_wide = gemm_sm90.GemmKnobs.tile(256, 2, 1, 5, 1)
    assert ping_pong_wide.staged_stages(sources, 1) == 3          # 5 stages made 3 for two 32 KB tiles
    assert gemm_sm90.COOPERATIVE.staged_stages(sources, 1) is None    # two 64 KB tiles do not fit beside 3 stages
    assert replace(ping_pong_wide, SPLIT=2).staged_stages(sources, 1) is None
    for knobs in gemm_sm90.GemmKnobs.space(2):
        stages = knobs.staged_stages(sources, 1)
        if stages is not None:
            assert replace(knobs, STAGES=stages).smem_bytes(sources) <= sm90_engine.MAX_SMEM


def test_suggestions_stage_the_residual():
    """With a residual, the level-0 choice of a wave-filling linear stages it."""
    from kiln_ops_builtin.templates import gemm_sm90
    task = _linear_residual(1024, 768, 768)
    assert gemm_sm90.GemmKnobs(**gemm_sm90.suggest(task, 132)[0]).staged_stages(_sources(task), 12) is not None


def test_a_long_main_loop_loads_its_sources_from_global_memory():
    """Past MAX_STAGED_K_TILES k-tiles the ring keeps its depth and the epilogue loads the
    residuals; the level-0 choice is then the tile a plain linear of the shape takes."""
    from kiln_ops_builtin.templates import gemm_sm90
    long_k = _linear_residual(1576, 3072, 768, residuals=2)
    knobs = gemm_sm90.suggest(long_k, 132)[0]
    assert gemm_sm90.GemmKnobs(**knobs).staged_stages(_sources(long_k), 3072 // 64) is None
    assert knobs == gemm_sm90.suggest(_fused_task(lambda x, w, b: ops.linear(x, w, b),
                                                  [(1576, 3072), (768, 3072), (768,)]), 132)[0]
    assert "NSRC = 0," in gemm_sm90.render(long_k, **knobs).source
    short_k = _linear_residual(1576, 768, 768, residuals=2)
    assert "NSRC = 2," in gemm_sm90.render(short_k, **gemm_sm90.suggest(short_k, 132)[0]).source


def _gemm_settings(task):
    from kiln_ops_builtin.templates import gemm_sm90
    settings = []
    for knobs in gemm_sm90.TEMPLATE.space(1) + gemm_sm90.suggest(task, 132)[:2]:
        if knobs not in settings:
            settings.append(knobs)
    return settings


@needs_nvrtc
def test_every_setting_with_sources_compiles_for_sm90a():
    from kiln_ops_builtin.templates import conv_sm90, gemm_sm90
    task = _linear_residual(300, 64, 136, residuals=2)
    programs = [gemm_sm90.render(task, **k) for k in _gemm_settings(task)]
    assert any("NSRC = 2," in p.source for p in programs)
    unaligned = _linear_residual(77, 128, 133)
    assert all("NSRC = 0," in gemm_sm90.render(unaligned, **k).source for k in _gemm_settings(unaligned))
    conv = _conv_residual_task()
    programs += [conv_sm90.render(conv, **k) for k in conv_sm90.TEMPLATE.space(1)]
    assert any("NSRC = 1," in p.source for p in programs[-len(conv_sm90.TEMPLATE.space(1)):])
    rt.compile_many([(p.source, p.kernel_names[0], "sm_90a") for p in programs])


def _conv_residual_task(dtype="float16"):
    """relu(conv2d_channels_last(x, w) + r), a 1x1 convolution of x: [3, 10, 9, 64] NHWC."""
    return _fused_task(lambda x, w, r: ops.relu(ops.add(ops.conv2d_channels_last(x, w), r)),
                       [(3, 10, 9, 64), (72, 1, 1, 64), (3, 10, 9, 72)], dtype)


# ---------------------------------------------------------------- on the GPU

def _needs_sm90():
    if rt.arch_number(rt.device_info(0)["arch"]) < 90:
        pytest.skip("the Hopper engine needs sm_90")


def _run(program, args, shape, dtype):
    from kiln.runtime.backend import backend_for
    runner = backend_for(kiln.device("cuda")).load(program, kiln.device("cuda"))
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    runner(args, [out])
    torch.cuda.synchronize()
    assert not out.isnan().any(), "some outputs were never written"
    return out


def _check(out, expected):
    err = ((out.double() - expected).norm() / expected.norm()).item()
    assert err < 1e-2, f"relative error {err}"
    tol = 1e-2 if out.dtype == torch.float16 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,k,n,residuals", [(300, 64, 136, 1), (1000, 776, 520, 2), (77, 128, 133, 1)])
def test_linear_with_residuals_matches_float64_at_every_setting(m, k, n, residuals, dtype):
    """N = 133: rows of 266 bytes, not a multiple of 16, so the residual loads from global memory."""
    from kiln_ops_builtin.templates import gemm_sm90
    _needs_sm90()
    task = _linear_residual(m, k, n, residuals, dtype)
    tdt = getattr(torch, dtype)
    x, w, b = rand((m, k), tdt).cuda(), rand((n, k), tdt).cuda(), rand((n,), tdt).cuda()
    rs = [rand((m, n), tdt, -1, 1).cuda() for _ in range(residuals)]
    expected = torch.relu(torch.nn.functional.linear(x.double(), w.double(), b.double()) + sum(r.double() for r in rs))
    for knobs in _gemm_settings(task):
        _check(_run(gemm_sm90.render(task, **knobs), [x, w, b, *rs], (m, n), tdt), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_conv_with_residual_matches_float64_at_every_setting(dtype):
    from kiln_ops_builtin.templates import conv_sm90
    _needs_sm90()
    task = _conv_residual_task(dtype)
    tdt = getattr(torch, dtype)
    x, w, r = (rand(shape, tdt, -1, 1).cuda() for shape in ((3, 10, 9, 64), (72, 1, 1, 64), (3, 10, 9, 72)))
    expected = torch.relu(conv_reference(x, w, None, {}) + r.double())
    for knobs in conv_sm90.TEMPLATE.space(1):
        _check(_run(conv_sm90.render(task, **knobs), [x, w, r], (3, 10, 9, 72), tdt), expected)
