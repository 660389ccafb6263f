"""In-place updates stored by the kernel computing their rows (`kiln.passes.row_stores`, issue
31): a StoreRows node whose rows and offsets come from an element-wise kernel with distinct
offsets goes, that kernel writing the rows into the input's memory; offsets that may repeat,
a read of the old value (or of a view of it) between the kernel and the store, or a kernel
reading the input itself keep the StoreRows launch. Values are those of the graph before."""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln import ops
from kiln.graph import FlowGraph
from kiln.graph.in_place import is_store, stored_into
from kiln.ir.row_stores import row_stores
from kiln.passes import StoreRowsInKernels, UpdateInPlace
from kiln.runtime import cuda as rt
from kiln.schedule.choose import choose
from support import rand
from tests.passes.passes_support import apply


def _folded(graph: FlowGraph, written: dict[int, int]) -> tuple[FlowGraph, FlowGraph]:
    """(`graph` with its updates in place, then with their rows stored by their kernels)."""
    in_place = UpdateInPlace(written)(kiln.graph.optimize(graph))
    return in_place, apply(StoreRowsInKernels(), in_place)


def _check_values(graph: FlowGraph, opt: FlowGraph, written: dict[int, int], inputs: list[torch.Tensor]):
    """`opt` compiled and run updates its written inputs in place to `graph`'s outputs, and
    returns `graph`'s other outputs (16-bit ones within their rounding: a fused epilogue reads
    its anchor's sum unrounded, where the graph rounds it before the next operator)."""
    want = [t.torch() for t in graph.run([x.clone() for x in inputs])]
    got = opt.compile().run(inputs)
    for k, w in enumerate(want):
        rounded = k not in written and w.dtype in (torch.bfloat16, torch.float16)
        torch.testing.assert_close(inputs[written[k]] if k in written else got[k], w,
                                   rtol=1.6e-2 if rounded else 0, atol=1e-2 if rounded else 0)


def _keys_and_values(dtype="float32", heads=2, length=12, dim=6):
    """Keys and values written at a position along dim 2, then read whole."""
    k, v = kiln.symbol([1, heads, length, dim], dtype), kiln.symbol([1, heads, length, dim], dtype)
    position, new = kiln.symbol([1], "int64"), kiln.symbol([1, heads, 1, dim], dtype)
    k2 = ops.index_copy(k, 2, position, ops.mul(new, 2.0))
    v2 = ops.index_copy(v, 2, position, ops.neg(new))
    y = ops.add(ops.sum(k2, [2]), ops.sum(v2, [2]))
    return kiln.trace_from([y, k2, v2], [k, v, position, new])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_keys_and_values_are_stored_by_the_kernel_computing_their_rows(dtype):
    name = str(dtype).removeprefix("torch.")
    graph = _keys_and_values(name, dim=10)
    in_place, opt = _folded(graph, {1: 0, 2: 1})
    stores = sum(is_store(n) for n in in_place.nodes)
    assert stores and not any(is_store(n) for n in opt.nodes)
    (node,) = [n for n in opt.nodes if row_stores(n.task)]
    assert len(row_stores(node.task)) == 2 and len(stored_into(node)) == 2
    assert len(opt.nodes) == len(in_place.nodes) - stores
    for position in (0, 11, 5, -1):
        inputs = [rand((1, 2, 12, 10), dtype), rand((1, 2, 12, 10), dtype), torch.tensor([position]),
                  rand((1, 2, 1, 10), dtype)]
        _check_values(graph, opt, {1: 0, 2: 1}, inputs)


def test_offsets_that_may_repeat_keep_the_store():
    """Two positions along dim 1: their values may be equal, and a GPU would store either
    row last; the StoreRows node (the later row wins) stays."""
    x, position, new = kiln.symbol([2, 8, 4]), kiln.symbol([2], "int64"), kiln.symbol([2, 2, 4])
    updated = ops.index_copy(x, 1, position, ops.mul(new, 3.0))
    graph = kiln.trace_from([ops.sum(updated, [1]), updated], [x, position, new])
    _, opt = _folded(graph, {1: 0})
    assert any(is_store(n) for n in opt.nodes) and not any(row_stores(n.task) for n in opt.nodes)
    _check_values(graph, opt, {1: 0}, [rand((2, 8, 4)), torch.tensor([3, 3]), rand((2, 2, 4))])


def _old_read_between(view: bool):
    """x updated at a position: the update (the rows' kernel), then a node reading x's old value
    (or a view of it made before the update), then the reader of the new value."""
    x, position, new = kiln.symbol([2, 8, 4]), kiln.symbol([1], "int64"), kiln.symbol([2, 1, 4])
    rows = ops.mul(new, 3.0)
    seen = ops.reshape(x, [2, 32]) if view else x
    old = ops.sum(seen, [1])
    updated = ops.index_copy(x, 1, position, rows)
    total = ops.sum(updated, [1])
    nodes = [rows.trace[0], *([seen.trace[0]] if view else []), updated.trace[0], old.trace[0], total.trace[0]]
    return FlowGraph([old, total, updated], [x, position, new], nodes)


@pytest.mark.parametrize("view", [False, True])
def test_a_read_of_the_old_value_between_the_rows_and_the_store_keeps_the_store(view):
    graph = _old_read_between(view)
    in_place = UpdateInPlace({2: 0})(graph)
    names = [n.name for n in in_place.nodes]
    assert names.index("UpdateRows") < names.index("Sum") < names.index("StoreRows"), names
    opt = apply(StoreRowsInKernels(), in_place)
    assert any(is_store(n) for n in opt.nodes) and not any(row_stores(n.task) for n in opt.nodes)
    _check_values(graph, opt, {2: 0}, [rand((2, 8, 4)), torch.tensor([6]), rand((2, 1, 4))])


def test_rows_read_from_the_input_itself_keep_the_store():
    """The new rows are computed from the cache (its first row): the kernel computing them
    reads the input, and storing into it there could change what another element reads."""
    x, position, new = kiln.symbol([3, 12, 5]), kiln.symbol([1], "int64"), kiln.symbol([3, 1, 5])
    updated = ops.index_copy(x, 1, position, ops.add(ops.mul(ops.slice(x, 1, 0, 1), 2.0), new))
    graph = kiln.trace_from([ops.sum(updated, [1]), updated], [x, position, new])
    _, opt = _folded(graph, {1: 0})
    assert not any(row_stores(n.task) for n in opt.nodes)
    _check_values(graph, opt, {1: 0}, [rand((3, 12, 5)), torch.tensor([0]), rand((3, 1, 5))])


def test_the_pass_disabled_keeps_the_store():
    graph = _keys_and_values()
    in_place = UpdateInPlace({1: 0, 2: 1})(kiln.graph.optimize(graph))
    with kiln.PassContext(disabled_passes={"store_rows_in_kernels"}):
        assert StoreRowsInKernels()(in_place) is in_place


@pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int64"])
def test_the_kernel_storing_its_rows_is_one_cuda_launch_and_compiles(dtype):
    """On CUDA symbols: the rows, their offsets and both stores in one launch, built by NVRTC
    for sm_80 and sm_90."""
    k, v = kiln.symbol([1, 2, 24, 10], dtype, "cuda"), kiln.symbol([1, 2, 24, 10], dtype, "cuda")
    position, new = kiln.symbol([1], "int64", "cuda"), kiln.symbol([1, 2, 1, 10], dtype, "cuda")
    k2, v2 = ops.index_copy(k, 2, position, ops.mul(new, 2.0)), ops.index_copy(v, 2, position, new)
    graph = kiln.trace_from([ops.add(ops.sum(k2, [2]), ops.sum(v2, [2])), k2, v2], [k, v, position, new])
    _, opt = _folded(graph, {1: 0, 2: 1})
    (node,) = [n for n in opt.nodes if row_stores(n.task)]
    assert not any(is_store(n) for n in opt.nodes)
    program = choose(node.task, "cuda", 90)
    assert len(program.launches) == 1
    rt.compile_many([(rt.launch_source(program, arch), "rows_stored", arch) for arch in ("sm_80", "sm_90")], workers=2)
