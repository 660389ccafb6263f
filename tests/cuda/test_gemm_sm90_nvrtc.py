"""The Hopper GEMM engine (`gemm_sm90`) without a GPU: which tasks it takes and declines, its
tensor maps (layouts, batch broadcasting), its level-0 choices, and every knob setting of its
level-2 space compiled with NVRTC for sm_90a (both B layouts, batched with broadcasting, fused
bias, split-K)."""
import pytest
import torch

import kiln
from kiln import dtypes
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln.runtime.cuda import TensorMapArg
from kiln_ops_builtin.templates import gemm_sm90
from kiln_ops_builtin.templates.sm90_engine import MAX_SMEM

SMS = 132
COOPERATIVE, CLUSTERED, PING_PONG = (k.as_dict() for k in (gemm_sm90.COOPERATIVE, gemm_sm90.CLUSTERED,
                                                           gemm_sm90.PING_PONG))


def _tile(**knobs):
    """The setting of a tile alone (no cluster), `knobs` over the cooperative 128 x 256 one."""
    return dict(COOPERATIVE, **knobs)
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _task(op, *shapes, dtype=torch.float16):
    definition = registry().operator(op)
    args = [kiln.from_torch(torch.ones(s, dtype=dtype)) for s in shapes]
    return definition.task(definition.bind(args, {}))[0]


def _maps(task, knobs):
    main = gemm_sm90.render(task, **knobs).launches[0]
    return [a for a in main.args if isinstance(a, TensorMapArg)]


def test_declines_what_tma_cannot_describe():
    assert gemm_sm90.applies(_task("matmul", (64, 72), (72, 64)))
    assert not gemm_sm90.applies(_task("matmul", (64, 70), (70, 64)))               # K-major rows of 140 bytes
    assert not gemm_sm90.applies(_task("matmul", (64, 72), (72, 45)))               # N-major rows of 90 bytes
    assert gemm_sm90.applies(_task("linear", (64, 72), (45, 72)))                   # K-major B: N is free
    assert not gemm_sm90.applies(_task("matmul", (64, 72), (72, 64), dtype=torch.float32))


def _tf32_task(op, *shapes):
    definition = registry().operator(op)
    args = [kiln.from_torch(torch.ones(s)) for s in shapes]
    return definition.task(definition.bind(args, {"allow_tf32": True}))[0]


def test_float32_only_with_allow_tf32_and_k_major_operands():
    assert gemm_sm90.applies(_tf32_task("linear", (64, 72), (45, 72)))
    assert not gemm_sm90.applies(_task("linear", (64, 72), (45, 72), dtype=torch.float32))   # not allowed
    assert not gemm_sm90.applies(_tf32_task("matmul", (64, 72), (72, 64)))       # N-major B: no TF32 transpose
    assert not gemm_sm90.applies(_tf32_task("linear", (64, 70), (45, 70)))       # rows of 280 bytes
    a, b = _maps(_tf32_task("linear", (1000, 776), (4104, 776)), COOPERATIVE)
    assert (a.box, b.box) == ((32, 128), (32, 256))                              # 128-byte rows of 32 floats


@needs_nvrtc
def test_tf32_knobs_compile_with_nvrtc():
    task = _tf32_task("linear", (3, 45, 776), (1032, 776), (1032,))
    programs = [gemm_sm90.render(task, **knobs) for knobs in gemm_sm90.TEMPLATE.space(1)]
    assert all("k8.f32.tf32.tf32" in p.source for p in programs)
    rt.compile_many([(p.source, f"tf32_{k}", p.arch_for("sm_90")) for k, p in enumerate(programs)], workers=2)


def test_b_layouts_map_k_major_and_n_major():
    knobs = COOPERATIVE
    a, b = _maps(_task("linear", (1000, 776), (4104, 776)), knobs)
    assert (a.dims, a.strides, a.box) == ((776, 1000), (1, 776), (64, 128))
    assert (b.dims, b.strides, b.box) == ((776, 4104), (1, 776), (64, 256))
    _, b = _maps(_task("matmul", (1000, 776), (776, 4104)), knobs)
    assert (b.dims, b.strides, b.box) == ((4104, 776), (1, 4104), (64, 64))      # four 64-wide boxes a stage
    program = gemm_sm90.render(_task("matmul", (1000, 776), (776, 4104)), **knobs)
    assert "kiln_transpose" not in program.source and len(program.launches) == 1


def test_batch_broadcast_gets_no_batch_dimension():
    a, b = _maps(_task("matmul", (2, 3, 128, 64), (3, 64, 128)), COOPERATIVE)
    assert a.dims == (64, 128, 6) and a.strides[2] == 128 * 64      # (2, 3) contiguous: one dim
    assert b.dims == (128, 64, 3) and b.strides[2] == 64 * 128      # broadcast over the 2: absent
    a, b = _maps(_task("matmul", (4, 130, 96), (96, 264)), COOPERATIVE)
    assert a.dims == (96, 520) and len(b.dims) == 2      # contiguous (batch, row) of A: one M of 520 rows


def test_clusters_share_b_by_multicast():
    knobs = dict(COOPERATIVE, CLUSTER=2)
    program = gemm_sm90.render(_task("linear", (1000, 776), (4104, 776)), **knobs)
    a, b = [arg for arg in program.launches[0].args if isinstance(arg, TensorMapArg)]
    assert (a.box, b.box) == ((64, 128), (64, 128))            # each CTA of a pair loads half of the 256 B rows
    assert ("kiln::sm90::load_operand<0, 128, 2>(bs, maps.B, bar, k0, (int)n0, rank, kiln::tma::Batch<0>{}, bz);"
            in program.source)
    launch = program.launches[0]
    assert (launch.cluster, launch.items) == (2, 4 * 17 * 2)    # pairs of 128-row tiles: 4 of M x 17 of N
    program = gemm_sm90.render(_task("matmul", (1000, 776), (776, 4104)), **knobs)
    assert ("kiln::sm90::load_operand<1, 2, 2>(bs, maps.B, bar, k0, (int)n0, rank, kiln::tma::Batch<0>{}, bz);"
            in program.source)
    with pytest.raises(ValueError, match="clusters of 2 at BN=64"):    # one 64-column box: nothing to split
        gemm_sm90.render(_task("matmul", (1000, 776), (776, 4104)), **dict(COOPERATIVE, BN=64, CW=1, STAGES=8, CLUSTER=2))


def _output_map(task, **knobs):
    program = gemm_sm90.render(task, **knobs)
    maps = [a for a in program.launches[0].args if isinstance(a, TensorMapArg) and a.param == "out0"]
    assert ("TMA_STORE = 1" in program.source) == bool(maps)
    return maps[0] if maps else None


def test_tma_store_maps_dense_16bit_outputs_only():
    knobs = dict(COOPERATIVE, TMA_STORE=1)
    out = _output_map(_task("linear", (1000, 776), (4104, 776), (4104,)), **knobs)
    assert (out.dims, out.strides, out.box, out.swizzle) == ((4104, 1000), (1, 4104), (64, 16), 128)
    out = _output_map(_task("matmul", (2, 3, 70, 64), (3, 64, 40)), **knobs)     # one batch dim of 6 images
    assert (out.dims, out.strides, out.box) == ((40, 70, 6), (1, 40, 2800), (64, 16, 1))
    assert _output_map(_task("linear", (1000, 776), (4100, 776)), **knobs) is None      # rows of 8200 bytes
    assert _output_map(_tf32_task("linear", (1000, 776), (4104, 776)), **knobs) is None  # float32 outputs
    assert _output_map(_task("linear", (64, 4096), (4104, 4096)), **dict(knobs, SPLIT=4)) is None
    assert _output_map(_task("linear", (1000, 776), (4104, 776)), **COOPERATIVE) is None


def test_packed_epilogue_where_tma_could_store():
    """PACKED (GemmKnobs' default) packs 16-bit outputs that `output_map` describes at tiles of a
    multiple of 64 columns, and only where TMA_STORE does not store them; elsewhere the epilogue
    stages float32 accumulators as with PACKED = 0."""
    linear = _task("linear", (1000, 776), (4104, 776), (4104,))
    source = lambda task, **knobs: gemm_sm90.render(task, **dict(COOPERATIVE, **knobs)).source
    assert "PACKED = 1" in source(linear) and "out_at" in source(linear) and "TMA_STORE = 0" in source(linear)
    assert "PACKED = 0" in source(linear, PACKED=0)
    assert "PACKED = 0" in source(linear, TMA_STORE=1) and "TMA_STORE = 1" in source(linear, TMA_STORE=1)
    assert "PACKED = 0" in source(linear, BN=96) and "PACKED = 1" in source(linear, BN=192, PP=1)
    assert "PACKED = 0" in source(_task("linear", (1000, 776), (4100, 776)))          # rows of 8200 bytes
    assert "PACKED = 0" in source(_tf32_task("linear", (1000, 776), (4104, 776)))      # float32 outputs
    assert "PACKED = 0" in source(_task("linear", (64, 4096), (4104, 4096)), SPLIT=4)


@pytest.mark.parametrize("items,max_clusters,grid", [(136, None, 132), (136, 60, 120), (6, 60, 6), (2, 1, 2)])
def test_cluster_launches_cover_whole_clusters_that_fit_at_once(items, max_clusters, grid):
    launch = rt.Launch("k", (), (384, 1, 1), items=items, per_block=1, waves=1, cluster=2)
    assert launch.shape_for(SMS, max_clusters) == ((grid, 1, 1), (384, 1, 1))


def test_tensor_map_arg_rejects_bad_strides():
    with pytest.raises(ValueError, match="16 bytes"):
        TensorMapArg("in0", dtypes.float16, (70, 64), (1, 70), (64, 64))
    with pytest.raises(ValueError, match="box"):
        TensorMapArg("in0", dtypes.float16, (128, 64), (1, 128), (128, 64))


@pytest.mark.parametrize("m,k,n,first", [
    (4096, 4096, 4096, dict(CLUSTERED, PACKED=0)), (8192, 2048, 8192, dict(CLUSTERED, PACKED=0)),
    (4096, 768, 3072, CLUSTERED), (1576, 768, 2304, COOPERATIVE),
    (4096, 768, 2304, _tile(BN=128, CW=3)),
    (1024, 768, 3072, _tile(BN=192, STAGES=5, PP=1)),
    (1024, 768, 768, PING_PONG),
    (128, 768, 3072, _tile(BN=64, CW=1, STAGES=8)),
    (128, 3072, 768, _tile(BN=64, CW=1, STAGES=8, SPLIT=6))])
def test_level0_choice(m, k, n, first):
    assert gemm_sm90.suggest(_task("linear", (m, k), (n, k)), SMS)[0] == first


@pytest.mark.parametrize("a,b,first", [
    ((32, 1024, 128), (32, 128, 1024), dict(CLUSTERED, TMA_STORE=1)),
    ((96, 128, 64), (96, 64, 128), dict(PING_PONG, TMA_STORE=1)),
    ((96, 128, 128), (96, 128, 64), _tile(BN=64, CW=1, STAGES=8))])
def test_level0_choice_of_attention_shapes(a, b, first):
    assert gemm_sm90.suggest(_task("matmul", a, b), SMS)[0] == first


def test_space_fits_shared_memory():
    for level in (0, 1, 2):
        for knobs in gemm_sm90.GemmKnobs.space(level):
            assert knobs.smem_bytes() <= MAX_SMEM, knobs
    assert gemm_sm90.TEMPLATE.space(0) == [CLUSTERED] == [gemm_sm90.GemmKnobs().as_dict()]
    with pytest.raises(ValueError, match="unsupported setting"):
        gemm_sm90.GemmKnobs(BN=256, MI=2)             # 256 accumulators a thread


def _ptxas_log(source: str) -> str:
    """ptxas's verbose log of `source` compiled by NVRTC for sm_90a."""
    from cuda.bindings import nvrtc
    program = nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])[1]
    try:
        options = [o.encode() for o in (*rt.BASE_OPTIONS, "--gpu-architecture=sm_90a", "--ptxas-options=-v")]
        assert int(nvrtc.nvrtcCompileProgram(program, len(options), options)[0]) == 0
        log = bytearray(nvrtc.nvrtcGetProgramLogSize(program)[1])
        nvrtc.nvrtcGetProgramLog(program, log)
        return log.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(program)


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("call", [("matmul", (4096, 4096), (4096, 4096)), ("linear", (4096, 4096), (4096, 4096)),
                                  ("linear", (4096, 768), (3072, 768), (3072,))], ids=["x@W", "x@W.T", "bias"])
def test_level0_wgmmas_stay_asynchronous(call, dtype):
    """ptxas waits after every wgmma (warning C7514) where it finds an instruction touching the
    accumulators while wgmmas are in flight: an early ping-pong hand-off (a named-barrier arrive
    before the last wait) made it do so for float16 squares, at 0.6 of the speed."""
    task = _task(call[0], *call[1:], dtype=dtype)
    assert "C7514" not in _ptxas_log(gemm_sm90.render(task, **gemm_sm90.suggest(task, SMS)[0]).source)


CALLS = [("linear", (1000, 776), (4104, 776), (4104,)), ("matmul", (1000, 776), (776, 4104)),
         ("matmul", (2, 3, 200, 136), (3, 136, 72))]


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c[0] + "x".join("-".join(map(str, s)) for s in c[1:]))
def test_every_knob_setting_compiles_for_sm90a(call, dtype):
    task = _task(call[0], *call[1:], dtype=dtype)
    settings = []
    for knobs in gemm_sm90.TEMPLATE.space(2) + gemm_sm90.suggest(task, SMS)[:3]:
        if knobs not in settings:
            settings.append(knobs)
    programs = [gemm_sm90.render(task, **knobs) for knobs in settings]
    rt.compile_many([(p.source, p.kernel_names[0], "sm_90a") for p in programs])
