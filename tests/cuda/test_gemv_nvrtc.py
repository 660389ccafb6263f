"""The decode-shaped matmul templates without a GPU, `gemv` (M <= 4) and `gemv_tc` (5 to 16 rows
on the tensor cores): which tasks each takes and declines, their knobs and level-0 choices, and
every knob setting compiled with NVRTC for sm_80 and sm_90."""
import pytest
import torch

import kiln
from kiln.graph import trace_from
from kiln.ir import SymSize
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for, tuner
from kiln.template import match_contraction
from kiln.tensor import symbol
from kiln_ops_builtin.templates import gemv, gemv_tc

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _task(op, *tensors):
    definition = registry().operator(op)
    return definition.task(definition.bind([kiln.from_torch(t) for t in tensors], {}))[0]


def _ones(*shape, dtype=torch.float16):
    return torch.ones(shape, dtype=dtype)


def test_takes_decode_shapes_and_declines_the_rest():
    assert gemv.applies(_task("linear", _ones(1, 4096), _ones(11008, 4096)))
    assert gemv.applies(_task("linear", _ones(4, 72), _ones(5, 72), _ones(5)))
    assert gemv.applies(_task("linear", _ones(2, 1, 64, dtype=torch.float32), _ones(7, 64, dtype=torch.float32)))
    assert not gemv.applies(_task("linear", _ones(5, 4096), _ones(64, 4096)))         # M > 4: a GEMM
    assert not gemv.applies(_task("linear", _ones(1, 4100), _ones(64, 4100)))         # K not whole 16-byte vectors
    assert not gemv.applies(_task("matmul", _ones(1, 4096), _ones(4096, 64)))          # B contiguous along N
    assert not gemv.applies(_task("linear", _ones(1, 64, dtype=torch.int32), _ones(8, 64, dtype=torch.int32)))


@pytest.mark.parametrize("m,k,n,first", [
    (1, 4096, 4096, {"R": 2, "KW": 2, "SPLIT": 1, "PREFETCH": 0, "CLUSTER": False}),       # 512 blocks: two per SM
    (1, 4096, 1024, {"R": 2, "KW": 8, "SPLIT": 1, "PREFETCH": 0, "CLUSTER": False}),
    (4, 4096, 4096, {"R": 2, "KW": 2, "SPLIT": 1, "PREFETCH": 0, "CLUSTER": False}),
    (1, 65536, 16, {"R": 2, "KW": 8, "SPLIT": 16, "PREFETCH": 0, "CLUSTER": False}),       # more splits than a cluster
    (1, 16384, 128, {"R": 2, "KW": 8, "SPLIT": 3, "PREFETCH": 0, "CLUSTER": True}),
])
def test_level0_choice(m, k, n, first):
    assert gemv.suggest(_task("linear", _ones(m, k), _ones(n, k)), 132)[0] == first


@pytest.mark.parametrize("module,m,k,n", [(gemv, 1, 8192, 128), (gemv_tc, 8, 2048, 256)])
def test_split_k_in_a_cluster_on_sm90_only(module, m, k, n):
    """A split that a cluster holds is ranked in a cluster first; sm_90 (and a GPU-less plan) is
    offered it, sm_80 the same split through the sum kernel."""
    task = _task("linear", _ones(m, k), _ones(n, k))
    clustered, summed = module.suggest(task, 132)[:2]
    assert clustered["CLUSTER"] and clustered == dict(summed, CLUSTER=True) and summed["SPLIT"] > 1
    assert module.TEMPLATE.knob_arch(clustered) == 90 and module.TEMPLATE.knob_arch(summed) == 0
    for arch, first in ((None, clustered), (90, clustered), (80, summed)):
        assert tuner.candidates(module.TEMPLATE, task, 132, 0, arch) == [first]
        assert first in tuner.candidates(module.TEMPLATE, task, 132, 1, arch)
    assert clustered not in tuner.candidates(module.TEMPLATE, task, 132, 2, 80)


@pytest.mark.parametrize("module,m", [(gemv, 3), (gemv_tc, 8)])
def test_a_cluster_split_is_one_launch(module, m):
    """The SPLIT blocks of a tile of columns run as one cluster along x (grid (tiles * SPLIT, 1,
    batch)) and add their partials there: no workspace, no sum kernel, sm_90 and later; the same
    split without CLUSTER launches the sum kernel."""
    task = _task("linear", _ones(m, 1000), _ones(777, 1000), _ones(777))
    knobs = {"KW": 8, "SPLIT": 4}
    clustered, summed = module.render(task, CLUSTER=True, **knobs), module.render(task, **knobs)
    columns = summed.launches[0].grid[0]
    assert [l.kernel for l in summed.launches][1:] == ["kiln_split_k_sum"]
    launch, = clustered.launches
    assert launch.grid == (columns * 4, 1, 1) and launch.cluster == 4 and summed.launches[0].grid == (columns, 4, 1)
    assert clustered.temporaries == [] and clustered.min_arch == 90 and summed.min_arch == 80
    assert "CLUSTER = 1" in clustered.source and "CLUSTER = 0" in summed.source


@pytest.mark.parametrize("k,n", [(2048, 2048), (5632, 2048), (4864, 896)])
def test_decode_projections_at_batch_8_are_one_launch_on_sm90(k, n):
    """Llama's o and down projections and Qwen2's down projection, their residual added, at batch
    8 split K on 132 SMs: in a cluster, one launch, on sm_90 (and in a plan for any GPU); through
    the sum kernel on sm_80."""
    from kiln.graph import optimize
    from kiln.schedule import choose
    symbols = [symbol(shape, "bfloat16", "cuda") for shape in [(8, k), (n, k), (8, n)]]
    (node,) = optimize(trace_from(kiln.ops.add(kiln.ops.linear(symbols[0], symbols[1]), symbols[2]), symbols)).nodes
    for arch in (None, 90):
        program = choose(node.task, "cuda", arch)
        assert [l.kernel for l in program.launches] == ["kiln_gemv_tc"] and program.launches[0].cluster > 1
    assert [l.kernel for l in choose(node.task, "cuda", 80).launches] == ["kiln_gemv_tc", "kiln_split_k_sum"]


def test_a_cluster_holds_two_to_eight_splits():
    assert gemv.render(_task("linear", _ones(1, 64), _ones(8, 64)), KW=8, SPLIT=8, CLUSTER=True).launches[0].cluster == 8
    for module in (gemv, gemv_tc):
        for split in (1, 16):
            with pytest.raises(ValueError, match="unsupported setting"):
                module.render(_task("linear", _ones(8, 64), _ones(8, 64)), KW=8, SPLIT=split, CLUSTER=True)


def test_knobs():
    """Level 0 is GemvKnobs' defaults; level 1 every columns-per-warp and K-warps pair; level 2
    adds split-K over blocks (through the sum kernel, then in clusters); other values are refused."""
    assert gemv.TEMPLATE.space(0) == [{"R": 2, "KW": 4, "SPLIT": 1, "PREFETCH": 0, "CLUSTER": False}]
    assert len(gemv.TEMPLATE.space(1)) == 12 and len(gemv.TEMPLATE.space(2)) == 26
    assert gemv.TEMPLATE.space(2)[12:18] == [{"R": r, "KW": 8, "SPLIT": s, "PREFETCH": 0, "CLUSTER": False}
                                             for r in (1, 2) for s in (2, 4, 8)]
    assert gemv.TEMPLATE.space(2)[18:20] == [{"R": 2, "KW": kw, "SPLIT": 1, "PREFETCH": 2, "CLUSTER": False}
                                             for kw in (4, 8)]
    assert gemv.TEMPLATE.space(2)[20:] == [{"R": r, "KW": 8, "SPLIT": s, "PREFETCH": 0, "CLUSTER": True}
                                           for r in (1, 2) for s in (2, 4, 8)]
    task = _task("linear", _ones(1, 64), _ones(8, 64))
    with pytest.raises(ValueError, match="GemvKnobs: unsupported setting"):
        gemv.render(task, R=3, KW=4)


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_knob_setting_compiles(dtype):
    """For sm_80 and sm_90, but a cluster's for sm_90 only."""
    task = _task("linear", _ones(3, 1000, dtype=dtype), _ones(777, 1000, dtype=dtype), _ones(777, dtype=dtype))
    programs = [gemv.render(task, **knobs) for knobs in gemv.TEMPLATE.space(2)]
    rt.compile_many([(rt.launch_source(p, arch), p.kernel_names[0], arch)
                     for p in programs for arch in ("sm_80", "sm_90") if p.min_arch <= rt.arch_number(arch)])


def test_takes_batched_decode_shapes_and_declines_the_rest():
    assert gemv_tc.applies(_task("linear", _ones(8, 2048), _ones(5632, 2048)))
    assert gemv_tc.applies(_task("linear", _ones(5, 72), _ones(5, 72), _ones(5)))
    assert gemv_tc.applies(_task("linear", _ones(2, 8, 776, dtype=torch.bfloat16), _ones(7, 776, dtype=torch.bfloat16)))
    assert gemv_tc.applies(_task("linear", _ones(16, 64), _ones(9, 64)))
    assert not gemv_tc.applies(_task("linear", _ones(4, 4096), _ones(64, 4096)))        # M <= 4: gemv
    assert not gemv_tc.applies(_task("linear", _ones(17, 4096), _ones(64, 4096)))       # M > 16: a GEMM
    assert not gemv_tc.applies(_task("linear", _ones(8, 4100), _ones(64, 4100)))        # K not whole 16-byte vectors
    assert not gemv_tc.applies(_task("matmul", _ones(8, 4096), _ones(4096, 64)))         # B contiguous along N
    assert not gemv_tc.applies(_task("linear", _ones(8, 64, dtype=torch.float32), _ones(8, 64, dtype=torch.float32)))


def test_declines_a_symbolic_m():
    """Each M has its own source: a length of 5 to 16 rows goes to the GEMM templates' one."""
    x, w = symbol((2, SymSize.named("s0", 4), 768), "float16", "cuda"), symbol((512, 768), "float16", "cuda")
    task = trace_from([kiln.ops.linear(x, w)], [x, w]).nodes[0].task
    assert match_contraction(task).M == 8 and not gemv_tc.applies(task)


@pytest.mark.parametrize("m", [5, 8, 16])
def test_batched_decode_linears_schedule_here_on_a_gpu_with_tensor_cores(m):
    """Between gemv (M <= 4) and the GEMM templates, at sm_80 and sm_90 alike."""
    task = _task("linear", _ones(m, 2048), _ones(2048, 2048))
    for arch in (80, 90):
        assert schedules_for(task, "cuda", arch)[0].name == "gemv_tc"


@pytest.mark.parametrize("m,k,n,first", [
    (8, 2048, 32000, {"KW": 2, "SPLIT": 1, "PREFETCH": 0, "WARPS": 8, "CLUSTER": False}),     # 500 blocks: two per SM
    (8, 2048, 2048, {"KW": 8, "SPLIT": 2, "PREFETCH": 0, "WARPS": 8, "CLUSTER": True}),       # 128 blocks even at eight
    (16, 1024, 65536, {"KW": 1, "SPLIT": 1, "PREFETCH": 0, "WARPS": 8, "CLUSTER": False}),    # warps: split in two
    (16, 5632, 8192, {"KW": 8, "SPLIT": 1, "PREFETCH": 0, "WARPS": 8, "CLUSTER": False}),
    (8, 65536, 16, {"KW": 8, "SPLIT": 128, "PREFETCH": 0, "WARPS": 8, "CLUSTER": False}),
])
def test_level0_choice_tc(m, k, n, first):
    assert gemv_tc.suggest(_task("linear", _ones(m, k), _ones(n, k)), 132)[0] == first


def test_knobs_tc():
    """Level 0 is GemvTcKnobs' defaults; level 1 every K-warps count; level 2 adds split-K over
    blocks (through the sum kernel, then in clusters), sixteen warps a block and prefetching; other
    values are refused."""
    assert gemv_tc.TEMPLATE.space(0) == [{"KW": 4, "SPLIT": 1, "PREFETCH": 0, "WARPS": 8, "CLUSTER": False}]
    assert gemv_tc.TEMPLATE.space(1) == [{"KW": kw, "SPLIT": 1, "PREFETCH": 0, "WARPS": 8, "CLUSTER": False}
                                         for kw in (1, 2, 4, 8)]
    tc = lambda kw, split=1, prefetch=0, warps=8, cluster=False: {"KW": kw, "SPLIT": split, "PREFETCH": prefetch,
                                                                  "WARPS": warps, "CLUSTER": cluster}
    assert gemv_tc.TEMPLATE.space(2)[4:] == ([tc(8, s) for s in (2, 4, 8)] + [tc(16, warps=16)]
                                             + [tc(kw, prefetch=1) for kw in (4, 8)]
                                             + [tc(8, s, cluster=True) for s in (2, 4, 8)])
    task = _task("linear", _ones(8, 64), _ones(8, 64))
    with pytest.raises(ValueError, match="GemvTcKnobs: unsupported setting"):
        gemv_tc.render(task, KW=3)
    with pytest.raises(ValueError, match="GemvTcKnobs: unsupported setting"):
        gemv_tc.render(task, KW=16)                 # more K-warps than the block's eight warps


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [5, 16])
def test_every_knob_setting_compiles_tc(dtype, m):
    """For sm_80 and sm_90, but a cluster's for sm_90 only."""
    task = _task("linear", _ones(m, 1000, dtype=dtype), _ones(777, 1000, dtype=dtype), _ones(777, dtype=dtype))
    programs = [gemv_tc.render(task, **knobs) for knobs in gemv_tc.TEMPLATE.space(2)]
    rt.compile_many([(rt.launch_source(p, arch), p.kernel_names[0], arch)
                     for p in programs for arch in ("sm_80", "sm_90") if p.min_arch <= rt.arch_number(arch)])
