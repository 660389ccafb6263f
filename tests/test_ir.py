"""The compute IR: building expressions and computes, and simplification of index arithmetic.

Every simplification is checked twice: against the expected simpler form, and by evaluating the
original and simplified expressions at every point of the index space.
"""
from __future__ import annotations

import itertools
import random

import pytest

from kiln import dtypes
from kiln.ir import (
    Binary, Cast, Const, Select, Task, TensorInput, Var, bounds, cast, compute, maximum,
    minimum, reduce, select, simplify,
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
