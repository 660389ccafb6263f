"""The embedding gradient template (`embedding_grad`) without a GPU: which tasks it takes (the
operator's own only: `own_task`), that the CUDA schedule picks it, its launch plan and scratch
(the tokens' size, never the table's), and every variant compiled with NVRTC for sm_80 and
sm_90."""
import pytest
import torch

import kiln
from kiln.ir import Task, compute
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from kiln_ops_builtin.templates import embedding_grad

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
ARCHS = ("sm_80", "sm_90")
KERNELS = ["kiln_embedding_grad_zero", "kiln_embedding_grad_sort", "kiln_embedding_grad_chunks",
           "kiln_embedding_grad_combine"]


def _task(tokens=50, width=13, rows=37, dtype=torch.bfloat16, index_dtype=torch.int64, **kwargs):
    definition = registry().operator("embedding_backward")
    args = (torch.zeros(tokens, width, dtype=dtype), torch.zeros(tokens, dtype=index_dtype), rows)
    return definition.task(definition.bind(args, kwargs))[0]


def test_takes_the_operators_own_tasks_only():
    own = _task(padding_idx=3)
    assert embedding_grad.applies(own)
    assert [t.name for t in schedules_for(own, "cuda", 90)][:1] == ["embedding_grad"]
    assert [t.name for t in schedules_for(own, "cuda", 80)][:1] == ["embedding_grad"]
    relu = Task(own.name, own.inputs, [compute(own.outputs[0].shape, lambda *i: kiln.ir.maximum(own.outputs[0][i], 0.0))],
                own.attrs)
    assert not embedding_grad.applies(relu)                                   # a fused epilogue
    assert not embedding_grad.applies(Task(own.name, own.inputs, own.outputs, {**own.attrs, "anchor": 0}))
    assert not embedding_grad.applies(Task(own.name, own.inputs, own.outputs, {**own.attrs, "num_weights": 40}))


@pytest.mark.parametrize("dtype,acc", [(torch.bfloat16, kiln.dtypes.float32), (torch.float16, kiln.dtypes.float32),
                                       (torch.float32, kiln.dtypes.float32), (torch.float64, kiln.dtypes.float64)])
def test_launch_plan_and_scratch(dtype, acc):
    """Four launches; scratch of three ints a token and two rows of accumulators per chunk of
    CHUNK tokens: for Llama's table (32000 x 2048) and 512 tokens, 256 KB, not the 262 MB of a
    float32 table."""
    program = embedding_grad.render(_task(tokens=512, width=2048, rows=32000, dtype=dtype))
    assert [launch.kernel for launch in program.launches] == KERNELS
    chunks = 512 // embedding_grad.EmbeddingGradKnobs().CHUNK
    assert program.temporaries == [((3, 512), kiln.dtypes.int32), ((2, chunks, 2048), acc)]
    assert program.launches[0].items == 32000 * 2048
    assert program.launches[2].grid == (chunks, 2048 // 256, 1)
    scratch = sum(torch.Size(shape).numel() * t.nbytes for shape, t in program.temporaries)
    assert scratch <= 2 * 512 * 2048 * acc.nbytes // 32 + 3 * 512 * 4
    assert 'printf("Kiln: IndexError: embedding_backward: index %lld is out of range for a weight of 32000 rows' \
        in program.source


def test_padding_row_and_knobs():
    assert "PADDING = 3" in embedding_grad.render(_task(padding_idx=3)).source
    assert "PADDING = -1" in embedding_grad.render(_task(padding_idx=-1)).source
    assert "PADDING = -1" in embedding_grad.render(_task(padding_idx=37)).source     # no row of the table
    assert embedding_grad.TEMPLATE.space(0) == [{"THREADS": 256, "CHUNK": 32}]
    with pytest.raises(ValueError):
        embedding_grad.EmbeddingGradKnobs(CHUNK=48)


def test_no_tokens():
    """Zero tokens: the table is zeros (the other launches have no blocks, and are not made)."""
    program = embedding_grad.render(_task(tokens=0))
    assert [launch.empty for launch in program.launches] == [False, True, True, True]


@needs_nvrtc
def test_every_variant_compiles():
    """Each grad dtype with int64 and int32 indices, a padding row or none, every knob setting
    of level 2."""
    programs = []
    for k, dtype in enumerate((torch.float32, torch.float16, torch.bfloat16, torch.float64)):
        for index_dtype in (torch.int64, torch.int32):
            programs.append(embedding_grad.render(_task(dtype=dtype, index_dtype=index_dtype, padding_idx=k - 1)))
    programs += [embedding_grad.render(_task(tokens=300, width=700), **knobs) for knobs in embedding_grad.TEMPLATE.space(2)]
    rt.compile_many([(p.source, f"variant{k}", arch) for k, p in enumerate(programs) for arch in ARCHS])
