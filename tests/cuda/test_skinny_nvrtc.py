"""Skinny matmuls without a GPU: the templates' shape-aware suggestions (tile size and split-K,
`kiln_ops_builtin.templates.split_k`) fill the GPU for BERT/GPT-2 shapes at 128 tokens, keep
the default tile for large GEMMs, and every suggested program (split-K sum kernel, fused
bias + gelu epilogue included) compiles with NVRTC for sm_80 and sm_90."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for

ops = kiln.ops
SMS = 132        # an H100/H200
ARCHS = ("sm_80", "sm_90")
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _task(op, *shapes, dtype=torch.float16):
    definition = registry().operator(op)
    args = [kiln.from_torch(torch.zeros(s, dtype=dtype)) for s in shapes]
    return definition.task(definition.bind(args, {}))[0]


def _blocks(program) -> int:
    """Blocks of the program's contraction launch (the one with the most)."""
    return max(g[0] * g[1] * g[2] for g in (launch.shape_for(SMS)[0] for launch in program.launches
                                            if launch.kernel.startswith("kiln_matmul")))


def _compile(task, knob_sets):
    jobs = []
    for template in schedules_for(task, "cuda"):
        for knobs in knob_sets(template):
            program = template.render(task, **knobs)
            jobs += [(program.source, f"{template.name}_{arch}", program.arch_for(arch))
                     for arch in ARCHS if program.min_arch <= rt.arch_number(arch)]
    assert jobs
    rt.compile_many(jobs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_large_gemm_keeps_the_default_tile(dtype):
    """The tile, that is: how the epilogue stores (PACKED) follows the main loop's length."""
    def tile(knobs):
        return {k: v for k, v in knobs.items() if k != "PACKED"}
    task = _task("matmul", (4096, 4096), (4096, 4096), dtype=dtype)
    for template in schedules_for(task, "cuda"):
        assert tile(template.suggest(task, SMS)[0]) == tile(template.space(0)[0]), template.name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(128, 768, 768), (128, 768, 2304), (128, 768, 3072), (128, 3072, 768)])
def test_bert_shapes_fill_the_gpu(m, k, n, dtype):
    task = _task("matmul", (m, k), (k, n), dtype=dtype)
    for template in schedules_for(task, "cuda"):
        best = template.suggest(task, SMS)[0]
        blocks = _blocks(template.render(task, **best))
        resident = best.get("MIN_BLOCKS", 1)                  # matmul_simt runs two blocks an SM
        assert SMS // 2 <= blocks <= 2 * SMS * resident, (template.name, best, blocks)


def test_batched_attention_uses_small_tiles():
    task = _task("matmul", (12, 128, 64), (12, 64, 128))
    for template in schedules_for(task, "cuda"):
        assert _blocks(template.render(task, **template.suggest(task, SMS)[0])) >= 48, template.name


def test_split_k_program_shape():
    """A split-K program: the contraction on a (tiles, SPLIT, batch) grid, then the sum kernel
    over a float32 workspace [SPLIT][batch][M][N] that it passes as its last parameter."""
    task = _task("matmul", (17, 1000), (1000, 50), dtype=torch.float32)
    template = schedules_for(task, "cuda")[0]
    knobs = dict(template.suggest(task, SMS)[0])
    assert knobs.get("SPLIT", 1) > 1
    program = template.render(task, **knobs)
    main, total = program.launches
    assert main.grid[1] == knobs["SPLIT"] and total.kernel == "kiln_split_k_sum"
    assert program.temporaries == [((knobs["SPLIT"], 1, 17, 50), kiln.dtypes.float32)]
    assert main.args[-1] == total.args[-1] == "tmp0"


SKINNY = [("linear", (1, 768), (768, 768), (768,)), ("matmul", (17, 1000), (1000, 50)),
          ("matmul", (128, 3072), (3072, 768)),
          ("matmul", (17, 1000), (1000, 33)), ("linear", (1, 17, 768), (3072, 768), (3072,)),
          ("matmul", (12, 128, 64), (12, 64, 128)), ("matmul", (12, 128, 128), (12, 128, 64))]


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("call", SKINNY, ids=lambda c: "x".join("-".join(map(str, s)) for s in c[1:]) + c[0])
def test_suggestions_compile(call, dtype):
    """The first suggestion and the first split-K one of every template (odd N, M = 1, batched,
    B transposed for wgmma) compile for sm_80 and sm_90."""
    task = _task(call[0], *call[1:], dtype=dtype)

    def knob_sets(template):
        ranked = template.suggest(task, SMS)
        split = [k for k in ranked if k.get("SPLIT", 1) > 1][:1]
        return ranked[:1] + split
    _compile(task, knob_sets)


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fused_bias_gelu_split_k_compiles(dtype):
    x, w, b = (kiln.symbol(s, dtype, "cuda") for s in ([17, 1000], [1000, 50], [50]))
    graph = kiln.trace_from(ops.gelu(ops.add(ops.matmul(x, w), b)), [x, w, b])
    (fused,) = kiln.graph.optimize(graph).nodes
    assert fused.task.name == "matmul"
    _compile(fused.task, lambda template: [template.suggest(fused.task, SMS)[0]])
    assert all(t.suggest(fused.task, SMS)[0].get("SPLIT", 1) > 1 for t in schedules_for(fused.task, "cuda"))


def test_tuner_candidates_follow_the_suggestions():
    """Level 0 takes the first suggestion; levels 1 and 2 time the first few with the space,
    each knob setting once."""
    from kiln.schedule.tuner import SUGGESTED, candidates
    task = _task("matmul", (128, 768), (768, 768))
    for template in schedules_for(task, "cuda"):
        ranked = template.suggest(task, SMS)
        assert candidates(template, task, SMS, 0) == ranked[:1] and ranked[0].get("SPLIT", 1) > 1
        for level in (1, 2):
            found = candidates(template, task, SMS, level)
            assert found[:SUGGESTED[level]] == ranked[:SUGGESTED[level]]
            assert all(k in found for k in template.space(level))
            assert len({tuple(sorted(k.items())) for k in found}) == len(found)


def test_outputs_of_64_columns_take_64_wide_tiles():
    """Where N is 64, a wave-filling grid takes 64 x 64 tiles rather than 64 x 128 ones half
    past N (attention's batched 96 x 128 x 128 x 64: 1.13x on an H100); wider N keeps them."""
    from kiln_ops_builtin.templates import gemm_sm90
    narrow = gemm_sm90.suggest(_task("matmul", (96, 128, 128), (96, 128, 64)), SMS)[0]
    assert (narrow["BN"], narrow["CW"]) == (64, 1)
    wide = gemm_sm90.suggest(_task("matmul", (96, 128, 64), (96, 64, 128)), SMS)[0]
    assert wide["BN"] == 128
