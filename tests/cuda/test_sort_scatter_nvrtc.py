"""The sorting (`sort_bitonic`) and atomic scatter (`scatter_atomic`) templates without a GPU:
which tasks they take and decline (the operators' own tasks only: `own_task`), their launch
plans, and every variant compiled with NVRTC for sm_80 and sm_90."""
import pytest
import torch

import kiln
from kiln.ir import Task, compute
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln_ops_builtin.templates import scatter_atomic, sort_bitonic

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
ARCHS = ("sm_80", "sm_90")


def _task(op, *args, **kwargs):
    definition = registry().operator(op)
    return definition.task(definition.bind(args, kwargs))[0]


def _compile(programs):
    rt.compile_many([(p.source, f"variant{k}", arch) for k, p in enumerate(programs) for arch in ARCHS])


def test_sort_takes_the_operators_own_tasks_only():
    x = torch.randn(4, 9)
    for op, args in [("sort", (1, True)), ("argsort", (0,)), ("topk", (3,)), ("kthvalue", (2, 1, True)),
                     ("median", (0,)), ("nanmedian", (1,))]:
        assert sort_bitonic.applies(_task(op, x, *args)), op
    assert not sort_bitonic.applies(_task("mode", x, 1))                       # keeps the rank count
    assert not sort_bitonic.applies(_task("sort", torch.tensor(2.5)))          # 0-d
    assert not sort_bitonic.applies(_task("topk", x, 0))                       # empty outputs
    own = _task("argsort", x, 1)
    epilogue = Task("argsort", own.inputs, [compute(own.outputs[0].shape, lambda *i: own.outputs[0][i] + 1)], own.attrs)
    assert not sort_bitonic.applies(epilogue)                                 # a fused epilogue
    assert not sort_bitonic.applies(Task("argsort", own.inputs, own.outputs, {**own.attrs, "descending": True}))
    assert not sort_bitonic.applies(Task("argsort", own.inputs, own.outputs, {**own.attrs, "anchor": 0}))


@pytest.mark.parametrize("n,dtype,launches,smem", [
    (7, torch.float32, ["kiln_sort_rows"], 1024 * 8),                        # 146 rows per CTA of 1024 items
    (4097, torch.float32, ["kiln_sort_rows"], 8192 * 8),
    (4097, torch.float64, ["kiln_sort_chunks", "kiln_sort_step_8192_4096", "kiln_sort_merge_8192", "kiln_sort_emit"],
     4096 * 16),
    (20000, torch.int16, ["kiln_sort_chunks", "kiln_sort_step_16384_8192", "kiln_sort_merge_16384",
                          "kiln_sort_step_32768_16384", "kiln_sort_step_32768_8192", "kiln_sort_merge_32768",
                          "kiln_sort_emit"], 8192 * 8),
])
def test_sort_launch_plan(n, dtype, launches, smem):
    program = sort_bitonic.render(_task("sort", torch.zeros(5, n, dtype=dtype)))
    assert [launch.kernel for launch in program.launches] == launches
    assert {launch.smem for launch in program.launches if launch.grid} == {smem}
    assert bool(program.temporaries) == (len(launches) > 1)


@needs_nvrtc
def test_every_sort_variant_compiles():
    """Each key encoding (dtype), each operator on short and long rows with 32- and 64-bit keys."""
    programs = [sort_bitonic.render(_task("sort", torch.zeros(3, 1000, dtype=dtype), 1, True))
                for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool)]
    calls = [("sort", (1,)), ("argsort", (1, True)), ("topk", (5, 1, False)), ("kthvalue", (3, 1)), ("median", (1,)),
             ("nanmedian", (1, True))]
    for k, (op, args) in enumerate(calls):
        dtype = (torch.float32, torch.float64)[k % 2]
        programs.append(sort_bitonic.render(_task(op, torch.zeros(2, 9000, 3, dtype=dtype), *args)))
    _compile(programs)


def _scatter_calls(dtype):
    x, index, src = torch.zeros(6, 5, dtype=dtype), torch.zeros(4, 5, dtype=torch.int64), torch.zeros(4, 5, dtype=dtype)
    row = torch.zeros(3, dtype=torch.int64)
    return {
        "scatter_add": ("scatter_add", x, 0, index, src),
        "index_add": ("index_add", x, 0, row, torch.zeros(3, 5, dtype=dtype), 2),
        "index_put": ("index_put", x, [row, torch.zeros(1, dtype=torch.int32)], torch.zeros(3, dtype=dtype), True),
        "index_reduce": ("index_reduce", x, 1, row, torch.zeros(6, 3, dtype=dtype), "amax", False),
    }


def test_scatter_takes_reducing_scatters_only():
    for call in _scatter_calls(torch.float32).values():
        assert scatter_atomic.applies(_task(*call)), call[0]
    x, index = torch.zeros(6, 5), torch.zeros(4, 5, dtype=torch.int64)
    assert scatter_atomic.applies(_task("scatter_reduce", x, 1, index, torch.zeros(4, 5), "mean", False))
    assert not scatter_atomic.applies(_task("index_put", x, [torch.zeros(2, dtype=torch.int64)], torch.zeros(5)))
    assert not scatter_atomic.applies(_task("scatter", x, 0, index, torch.zeros(4, 5)))      # the last one wins
    assert not scatter_atomic.applies(_task("scatter_add", torch.zeros(6, 5, dtype=torch.int8), 0, index,
                                            torch.zeros(4, 5, dtype=torch.int8)))
    own = _task("scatter_add", x, 0, index, torch.zeros(4, 5))
    relu = Task("scatter_add", own.inputs, [compute(x.shape, lambda *i: kiln.ir.maximum(own.outputs[0][i], 0.0))],
                own.attrs)
    assert not scatter_atomic.applies(relu)


@pytest.mark.parametrize("how,include_self,launches", [
    ("sum", True, ["kiln_scatter_init", "kiln_scatter_apply"]),
    ("amax", False, ["kiln_scatter_zero", "kiln_scatter_count", "kiln_scatter_init", "kiln_scatter_apply"]),
    ("mean", True, ["kiln_scatter_zero", "kiln_scatter_count", "kiln_scatter_init", "kiln_scatter_apply",
                    "kiln_scatter_finish"]),
])
def test_scatter_launch_plan(how, include_self, launches):
    x, index = torch.zeros(6, 5), torch.zeros(4, 5, dtype=torch.int64)
    program = scatter_atomic.render(_task("scatter_reduce", x, 0, index, torch.zeros(4, 5), how, include_self))
    assert [launch.kernel for launch in program.launches] == launches
    half = scatter_atomic.render(_task("scatter_add", x.half(), 0, index, torch.zeros(4, 5).half()))
    assert half.launches[-1].kernel == "kiln_scatter_finish" and half.temporaries == [((6, 5), kiln.dtypes.float32)]


@needs_nvrtc
def test_every_scatter_variant_compiles():
    """Every reduction's atomic on 32- and 64-bit floats and integers (with and without x's own
    value, alternately), 16-bit floats through float32, every operator's hooks."""
    programs = []
    index, src = torch.zeros(4, 5, dtype=torch.int64), torch.zeros(4, 5)
    for k, dtype in enumerate((torch.float32, torch.float64, torch.int32, torch.int64)):
        for j, how in enumerate(("sum", "prod", "mean", "amax", "amin")):
            task = _task("scatter_reduce", torch.zeros(6, 5, dtype=dtype), 0, index, src.to(dtype), how, (j + k) % 2 == 0)
            programs.append(scatter_atomic.render(task))
    calls = list(_scatter_calls(torch.float32).values())[1:]
    calls += [_scatter_calls(dtype)["scatter_add"] for dtype in (torch.float16, torch.bfloat16)]
    _compile(programs + [scatter_atomic.render(_task(*call)) for call in calls])


@needs_nvrtc
@pytest.mark.parametrize("mask_shape", [(4, 1), (4, 5)])
def test_masked_scatter_from_a_source_of_several_dims_compiles(mask_shape):
    """`out[mask] = y` with y's rows: the source's index, unravelled from one count of the
    mask, holds copies of that count, each bound to its one reduction axis."""
    from kiln.schedule.choose import check_nvrtc
    check_nvrtc(_task("masked_scatter", torch.zeros(4, 5), torch.rand(mask_shape) > 0.5, torch.randn(4, 5)), ARCHS)
