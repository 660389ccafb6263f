"""The compute IR: building expressions and computes, simplification of index arithmetic, the
expression rewriter, unravelling of flat indices and the operation enums.

Every simplification is checked twice: against the expected simpler form, and by evaluating the
original and simplified expressions at every point of the index space.
"""
from __future__ import annotations

import itertools
import random

import pytest

from kiln import dtypes
from kiln.ir import (
    Binary, BinaryOp, Cast, Compute, Const, Load, Reduce, ReduceOp, Select, Task, TensorInput, UnaryOp, Var, binary,
    bounds, cast, compute, exp, inline_task, maximum, minimum, reduce, rewrite, select, simplify,
    substitute, unary, unravel,
)

INT_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "max": max, "min": min, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b,
    "and": lambda a, b: a and b, "or": lambda a, b: a or b,
}


def evaluate(e, env: dict):
    """The value of an integer/boolean index expression with variables bound in `env` (by id)."""
    if isinstance(e, Var):
        return env[id(e)]
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Cast):
        return bool(evaluate(e.a, env)) if e.dtype.is_bool else int(evaluate(e.a, env))
    if isinstance(e, Select):
        return evaluate(e.a, env) if evaluate(e.cond, env) else evaluate(e.b, env)
    if isinstance(e, Binary):
        return INT_OPS[e.op](evaluate(e.a, env), evaluate(e.b, env))
    raise TypeError(type(e).__name__)


def assert_equivalent(original, simplified, variables) -> None:
    """`original` and `simplified` agree at every point of the variables' ranges."""
    for point in itertools.product(*(range(v.extent) for v in variables)):
        env = {id(v): p for v, p in zip(variables, point)}
        assert evaluate(original, env) == evaluate(simplified, env), point


def size(e) -> int:
    return 1 + sum(size(c) for c in e.children())


def test_flatten_unflatten_round_trip_folds_to_the_indices():
    i0, i1 = Var("i0", 4), Var("i1", 12)
    flat = i0 * 12 + i1
    for original, expected in [(flat // 12, i0), (flat % 12, i1)]:
        s = simplify(original)
        assert s is expected
        assert_equivalent(original, s, [i0, i1])


def test_three_level_unflatten_of_a_flat_loop_index():
    o = Var("o", 2 * 3 * 5)
    a, b, c = (o // 15) % 2, (o // 5) % 3, o % 5
    flat = (a * 3 + b) * 5 + c
    assert simplify(flat) is o
    assert simplify(a).key() == (o // 15).key(), "o // 15 < 2 already: the % 2 folds away"
    for e in (a, b, c, flat):
        assert_equivalent(e, simplify(e), [o])


def test_reshape_chain_merges_div_and_mod_pairs():
    # reshape (6, 4) -> (24,) -> (3, 8): element (i, j) of the (3, 8) view reads row (i*8+j)//4
    i, j = Var("i", 3), Var("j", 8)
    flat = i * 8 + j
    row, col = flat // 4, flat % 4
    assert simplify(row).key() == (i * 2 + j // 4).key()
    assert simplify(col).key() == (j % 4).key()
    assert simplify(row * 4 + col).key() == flat.key()
    for e in (row, col, row * 4 + col):
        assert_equivalent(e, simplify(e), [i, j])


def test_multiples_of_the_divisor_move_out_of_div_and_mod():
    i, j = Var("i", 5), Var("j", 7)
    div, mod = (i * 14 + j + 3) // 7, (i * 14 + j + 3) % 7
    assert simplify(div).key() == (i * 2 + (j + 3) // 7).key()
    assert simplify(mod).key() == ((j + 3) % 7).key()
    assert_equivalent(div, simplify(div), [i, j])
    assert_equivalent(mod, simplify(mod), [i, j])


def test_a_row_index_read_back_through_another_grouping_of_its_dims():
    # layer_norm over rows of (4, 7, 129) flattened to (28, 129): element (o, e) of the output
    # reads the statistics of row ((o * 129 + e) // 903, (o * 129 + e) // 129 % 7), which is o
    o, e = Var("o", 28), Var("e", 129)
    flat = o * 129 + e
    first, second = flat // 903, flat // 129 % 7
    assert simplify(first).key() == (o // 7).key()
    assert simplify(second).key() == (o % 7).key()
    assert simplify(simplify(first) * 7 + simplify(second)) is o
    mod = (o * 129 + e + 5) % 903                 # the low part may not reach past the divisor
    assert_equivalent(mod, simplify(mod), [o, e])
    for x in (first, second, flat % 903, (o * 6 + e % 3 * 2) // 12, (o * 6 + e % 3 * 2) % 12):
        assert_equivalent(x, simplify(x), [o, e])


def test_constants_fold_and_identities_vanish():
    i = Var("i", 9)
    int64 = dtypes.int64
    assert simplify(Const(7, int64) * 3 + 1).value == 22
    assert simplify(Binary("floordiv", Const(-7, int64), Const(2, int64), int64)).value == -4
    assert simplify(Binary("mod", Const(-7, int64), Const(3, int64), int64)).value == 2
    assert simplify(i + 0) is i and simplify(i * 1) is i and simplify(i // 1) is i
    assert simplify(i % 1).value == 0 and simplify(i - i).value == 0
    assert simplify((i + 2) - 2) is i


def test_bounds_of_index_expressions():
    i, j = Var("i", 4), Var("j", 6)
    assert bounds(i) == (0, 3)
    assert bounds(i * 6 + j) == (0, 23)
    assert bounds(i - j) == (-5, 3)
    assert bounds((i * 6 + j) // 4) == (0, 5)
    assert bounds(j % 4) == (0, 3)
    assert bounds(maximum(i, 2)) == (2, 3) and bounds(minimum(j, 2)) == (0, 2)
    assert bounds(Var("n", Const(3, dtypes.int64))) is None


def test_comparisons_decided_by_bounds_fold_and_select_follows():
    i = Var("i", 8)
    assert simplify(i < 8).value is True and simplify(i >= 8).value is False
    undecided = simplify(i < 4)
    assert isinstance(undecided, Binary) and undecided.op == "lt"
    e = select(i < 8, i * 2, i)
    s = simplify(e)
    assert s.key() == simplify(i * 2).key()
    assert_equivalent(e, s, [i])
    assert simplify(maximum(i, 0)) is i and simplify(minimum(i, 7)) is i
    guarded = (i >= 0) & (i < 4)
    assert_equivalent(guarded, simplify(guarded), [i])
    assert simplify(guarded).key() == simplify(i < 4).key()


def test_division_by_a_negative_or_unknown_divisor_is_kept():
    i, j = Var("i", 5), Var("j", 3)
    for e in (i // (j + 1), i % (j + 1), (i * 4) // Const(-2, dtypes.int64)):
        s = simplify(e)
        assert isinstance(s, Binary) and s.op in ("floordiv", "mod", "mul")
        assert_equivalent(e, s, [i, j])


@pytest.mark.parametrize("seed", range(30))
def test_random_index_expressions_keep_their_value(seed):
    rng = random.Random(seed)
    variables = [Var(f"v{k}", rng.randint(1, 6)) for k in range(3)]

    def make(depth):
        if depth == 0 or rng.random() < 0.25:
            return rng.choice(variables) if rng.random() < 0.7 else Const(rng.randint(0, 9), dtypes.int64)
        op = rng.choice(["add", "sub", "mul", "floordiv", "mod", "max", "min"])
        a = make(depth - 1)
        if op in ("floordiv", "mod"):
            return Binary(op, a, Const(rng.randint(1, 12), dtypes.int64), dtypes.int64)
        return Binary(op, a, make(depth - 1), dtypes.int64)

    e = make(5)
    assert_equivalent(e, simplify(e), variables)


def test_float_expressions_are_left_alone():
    x = TensorInput("x", (4,), "float32")
    i = Var("i", 4)
    e = x[(i * 4 + 1) // 4] * 2.5
    s = simplify(e)
    assert s.dtype == dtypes.float32
    assert s.a.indices[0] is i
    assert s.b.value == 2.5


def test_a_tasks_nodes_are_found_once_and_handed_out_as_copies(monkeypatch):
    """Fusion composes every candidate group from its members' `Task.nodes()`: the walk is made
    once per task (a task does not change once built), and each caller gets a list of its own."""
    x = TensorInput("x", (3, 4), "float32")
    y = compute([3, 4], lambda i, j: x[i, j] * 2.0)
    task = Task("double", [x], [compute([3, 4], lambda i, j: y[i, j] + 1.0)])
    walked = []
    producers = Compute.producers
    monkeypatch.setattr(Compute, "producers", lambda self: walked.append(self) or producers(self))
    first = task.nodes()
    first.clear()
    assert task.nodes() == [x, y, task.outputs[0]] and not walked


def test_compute_reduce_and_task():
    x = TensorInput("x", (3, 4), "float16")
    total = compute([3], lambda i: reduce([4], lambda r: x[i, r], dtype="float32"))
    assert total.shape == (3,) and total.dtype == dtypes.float32 and total.has_reduce
    y = compute([3, 4], lambda i, j: cast(x[i, j], "float32") / total[i])
    task = Task("normalize", [x], [y])
    assert task.nodes() == [x, total, y]
    assert not task.is_injective
    assert repr(task) == "Task normalize(x: float16[3, 4]) -> float32[3, 4]"
    with pytest.raises(ValueError, match="reads tensor 'w' that is not one of its inputs"):
        Task("bad", [x], [compute([4], lambda i: TensorInput("w", (4,), "float32")[i])])
    with pytest.raises(IndexError, match="rank 2 indexed with 1 indices"):
        compute([3], lambda i: x[i])


def test_rewrite_visits_each_shared_node_once_and_keeps_sharing():
    i = Var("i", 8)
    shared = i * 3 + 1
    expr = shared * shared + shared
    visits = []

    def double_consts(e):
        visits.append(e)
        return Const(e.value * 2, e.dtype) if isinstance(e, Const) else e

    out = rewrite(expr, double_consts)
    assert len(visits) == len({id(e) for e in visits}), "every node once"
    assert out.a.a is out.a.b is out.b, "the shared sub-expression stays one node"
    assert_equivalent(out, (i * 6 + 2) * (i * 6 + 2) + (i * 6 + 2), [i])
    assert rewrite(expr, lambda e: e) is expr, "nothing changed: the same node back"


def test_rewrite_pre_replaces_without_visiting_children_and_memo_is_shared():
    i, j = Var("i", 4), Var("j", 5)
    inner = i + j
    expr = select(inner > 3, inner, j)
    seen = []
    out = rewrite(expr, lambda e: seen.append(e) or e, pre=lambda e: j if e is inner else None)
    assert all(e is not i for e in seen), "the replaced node's children are not visited"
    assert out.a is j and out.cond.a is j
    memo = {}
    first = rewrite(inner * 2, lambda e: e, pre=lambda e: Const(7, e.dtype) if e is i else None, memo=memo)
    second = rewrite(inner * 3, lambda e: e, memo=memo)
    assert first.a is second.a, "a shared memo rewrites a common sub-expression once"


def test_rewrite_handles_chains_deeper_than_the_recursion_limit():
    x = TensorInput("x", (4,), "float32")
    value = x[Var("i", 4)]
    for _ in range(5000):
        value = value * 1.5 + 1.0
    out = rewrite(value, lambda e: Const(2.5, e.dtype) if isinstance(e, Const) and e.value == 1.5 else e)
    assert out.a.b.value == 2.5 and out.b.value == 1.0
    substitute(value, {})     # substitution and simplification share the traversal
    simplify(value)


def test_substitute_and_inlining_through_the_rewriter():
    x = TensorInput("x", (3, 4), "float32")
    y = compute([3, 4], lambda a, b: exp(x[a, b]))
    z = compute([4, 3], lambda a, b: y[b, a] * 2.0)
    lowered = inline_task(Task("t", [x], [z]))
    (out,) = lowered.buffers
    load = out.value.a.a
    assert isinstance(load, Load) and load.tensor is x, "y is inlined into z"
    assert load.indices == (out.axes[1], out.axes[0])
    k = Var("k", 4)
    total = reduce([k + 1], lambda r: x[0, r])   # a reduction whose extent is an expression
    moved = substitute(total, {id(k): Const(2, dtypes.int64)})
    (axis,) = moved.axes
    assert axis is not total.axes[0] and simplify(axis.extent).value == 3
    assert moved.body.indices[1] is axis, "the body reads the new axis"


def test_substitute_gives_copies_of_a_reduction_one_new_axis():
    """Two copies of a reduction of variable extent sharing their axis and part of their body
    (simplification leaves such copies in two index expressions) keep one axis: the shared part,
    rewritten once, reads it in both."""
    x = TensorInput("x", (12,), "float32")
    k = Var("k", 12)
    shared = cast(x[Var("r", k + 1)], dtypes.int64)
    r = shared.a.indices[0]
    first = Reduce("sum", (r,), shared + 1, dtypes.int64)
    second = Reduce("sum", (r,), shared + 2, dtypes.int64)
    moved = substitute(first * second, {id(k): Const(5, dtypes.int64)})
    a, b = moved.a, moved.b
    assert a.axes[0] is b.axes[0] is not r and simplify(a.axes[0].extent).value == 6
    assert a.body.a.a.indices[0] is b.body.a.a.indices[0] is a.axes[0]


@pytest.mark.parametrize("extents", [(3, 4, 5), (1, 6, 1, 2), (7,), (2, 1)])
def test_unravel_gives_the_row_major_index(extents):
    n = 1
    for e in extents:
        n *= e
    flat = Var("o", n)
    index = unravel(flat, extents)
    assert len(index) == len(extents)
    points = list(itertools.product(*(range(e) for e in extents)))
    for o, point in enumerate(points):
        assert tuple(evaluate(ix, {id(flat): o}) for ix in index) == point
    assert all(isinstance(ix, Const) and ix.value == 0 for ix, e in zip(index, extents) if e == 1)
    assert index[0] is flat or size(index[0]) <= 3, "the outermost index needs no modulo"


def test_unravel_of_a_constant_folds():
    assert [e.value for e in unravel(23, (2, 3, 4))] == [1, 2, 3]


def test_operations_are_enums_that_equal_their_names():
    i = Var("i", 4)
    e = binary("floordiv", i, 2)
    assert e.op is BinaryOp.FLOORDIV and e.op == "floordiv" and f"{e.op}" == "floordiv"
    assert {"floordiv": 1}[e.op] == 1, "hashes like its name: string-keyed tables still work"
    assert unary("exp", cast(i, "float32")).op is UnaryOp.EXP
    assert reduce([4], lambda r: cast(i + r, "float32"), op="max").op is ReduceOp.MAX
    assert Binary("add", i, i, dtypes.int64).op is BinaryOp.ADD
    with pytest.raises(ValueError, match="unknown BinaryOp 'flordiv'; expected one of add, sub"):
        binary("flordiv", i, 2)
    with pytest.raises(ValueError, match="unknown ReduceOp 'mean'"):
        reduce([4], lambda r: cast(r, "float32"), op="mean")


def test_what_is_derived_from_a_task_is_computed_once_per_function_and_arguments():
    x = TensorInput("x", (4, 8), dtypes.float32)
    y = compute((4,), lambda i: reduce([8], lambda k: x[i, k]), name="y")
    task, other = Task("rowsum", [x], [y]), Task("rowsum", [x], [y])
    calls = []

    def outputs(t, scale):
        calls.append((t, scale))
        return [len(o.shape) * scale for o in t.outputs]

    first = task.derived(outputs, 1)
    assert task.derived(outputs, 1) is first and first == [1]
    assert task.derived(outputs, 2) == [2] and other.derived(outputs, 1) == [1]
    assert calls == [(task, 1), (task, 2), (other, 1)]


def test_a_contraction_is_matched_once_per_task():
    from kiln.codegen.hooks import match_contraction
    a, b = TensorInput("a", (16, 8), dtypes.float16), TensorInput("b", (8, 24), dtypes.float16)
    c = compute((16, 24), lambda m, n: reduce([8], lambda k: cast(a[m, k], "float32") * cast(b[k, n], "float32")),
                name="c")
    task = Task("matmul", [a, b], [c])
    found = match_contraction(task)
    assert (found.M, found.N, found.K) == (16, 24, 8)
    assert match_contraction(task) is found
    assert match_contraction(Task("matmul", [a, b], [c])) is not found
