"""Symbolic sizes (`kiln.ir.size`) in the IR and the code generators: SymSize arithmetic keeps
its expression exactly; tasks traced with symbolic dims at odd sizes give one kernel source for
every size, whose results are PyTorch's; a simplification that holds only at some sizes gives
those sizes their own source; bounds checks use the run-time size; schedules that do not take
sizes as arguments get the task specialized."""
import itertools
import pickle
import random

import pytest
import torch

import kiln
from kiln import dtypes
from kiln.codegen.sizes import SizeArgs
from kiln.graph import trace_from
from kiln.ir import Binary, Const, SizeVar, SymSize, Task, TensorInput, Var, compute, simplify, size_key
from kiln.ir.specialize import has_symbolic_sizes, specialize
from kiln.schedule import choose
from kiln.tensor import from_torch, symbol

SIZES = (1, 7, 33, 130)


def _value(e, env=None) -> int:
    """An int64 IR expression of sizes (and of index variables, valued by id in `env`)
    evaluated in Python (floor division and remainder)."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, SizeVar):
        return e.value
    if isinstance(e, Var):
        return env[id(e)]
    a, b = _value(e.a, env), _value(e.b, env)
    return {"add": a + b, "sub": a - b, "mul": a * b, "floordiv": a // b if b else 0, "mod": a % b if b else 0,
            "max": max(a, b), "min": min(a, b)}[e.op]


def test_symbolic_arithmetic_keeps_value_and_expression():
    s, t = SymSize.named("s0", 7), SymSize.named("s1", 33)
    assert (s * 16) // 16 == 7 and ((s * 16) // 16).polynomial == s.polynomial
    assert type(s - s) is int and type((2 * s + 2) // (s + 1)) is int and (2 * s + 2) // (s + 1) == 2
    assert ((s * t + 3) // s).polynomial != t.polynomial and (s * t + 3) // s == 33
    assert type(s * 0.5) is float and type(int(s)) is int and s == 7 and hash(s) == hash(7)
    assert pickle.loads(pickle.dumps(s)) == 7 and type(pickle.loads(pickle.dumps(s))) is int
    assert size_key(s) != size_key(7) and size_key(s) != size_key(SymSize.named("s2", 7))
    assert size_key((2, s)) == size_key((2, SymSize.named("s0", 7)))


@pytest.mark.parametrize("seed", range(4))
def test_random_size_expressions_evaluate_to_their_values(seed):
    rng = random.Random(seed)
    leaves = [SymSize.named("s0", rng.choice(SIZES)), SymSize.named("s1", rng.choice(SIZES)), 3, 16, 1]
    for _ in range(200):
        a, b = rng.choice(leaves), rng.choice(leaves)
        op = rng.choice(["+", "-", "*", "//", "%"])
        if op in ("//", "%") and b == 0:
            continue
        value = eval(f"a {op} b")
        assert value == eval(f"int(a) {op} int(b)")
        if isinstance(value, SymSize):
            assert _value(value.size_expr()) == value
            leaves.append(value)


def _index_expressions(s):
    """(expression, its index variables) pairs of index arithmetic over symbolic divisors."""
    o, i, j, il = Var("o", 2 * s), Var("i", s), Var("j", 128), Var("il", 16)
    return [((o // s) * s + o % s, [o]), ((o * s + i) // s, [o, i]), ((o * s + i) % s, [o, i]),
            ((o * s * 3 + i) // (s * 3), [o, i]), (j % s, [j]), ((o - 5) // s, [o]), ((o - 5) % s, [o]),
            ((o // s) * (s * 16) + (o % s) * 16 + il, [o, il]), ((i + 5) % s + (j // s) * s, [i, j])]


@pytest.mark.parametrize("n", SIZES)
def test_index_arithmetic_over_symbolic_divisors_simplifies_to_the_same_values(n):
    s = SymSize.named("s0", n)
    for e, variables in _index_expressions(s):
        simple = simplify(e)
        for values in itertools.product(*(range(int(v.extent)) for v in variables)):
            env = dict(zip(map(id, variables), values))
            assert _value(simple, env) == _value(e, env), (e, values)
    o = Var("o", 2 * s)
    assert simplify((o // s) * s + o % s) is o


def test_size_args_number_each_size_once_and_refuse_two_values():
    sizes = SizeArgs()
    s = SymSize.named("s0", 7)
    assert sizes.text(s * 4 + 1) == "(1 + (kiln_size0 * 4))" and sizes.text(12) == "12"
    assert sizes.param(SizeVar("s1", 33)) == "kiln_size1" and sizes.values == (7, 33)
    with pytest.raises(ValueError, match="s0 has two values"):
        sizes.param(SizeVar("s0", 8))


def _graph(n: int):
    """A graph over x: float32[s0, 5] (s0 = n) exercising rows, reductions over the symbolic
    dim, reshapes across it, a GEMM with it as M and as K, and a layer norm over it."""
    s = SymSize.named("s0", n)
    x, w = symbol((s, 5)), from_torch(torch.randn(5, 6))
    flipped = kiln.ops.permute(kiln.ops.reshape(kiln.ops.reshape(x, (-1,)), (5, s)), (1, 0))
    outs = [kiln.ops.softmax(x, 0), kiln.ops.sum(x, 0), flipped + 1, kiln.ops.matmul(x, w),
            kiln.ops.matmul(kiln.ops.permute(x, (1, 0)), x),
            kiln.ops.layer_norm(kiln.ops.permute(x, (1, 0)), (s,))]
    return trace_from(outs, [x])


def _expected(x: torch.Tensor, w: torch.Tensor) -> list:
    n = x.shape[0]
    return [x.softmax(0), x.sum(0), x.reshape(-1).reshape(5, n).T + 1, x @ w, x.T @ x,
            torch.nn.functional.layer_norm(x.T, (n,))]


def test_one_source_serves_every_size_and_each_size_is_right():
    sources = {}
    for n in SIZES:
        graph = _graph(n)
        sources[n] = [choose(node.task, "cpu").source for node in graph.nodes]
        x = torch.randn(n, 5)
        w = graph.constants[0].torch()
        for got, want in zip(graph(x), _expected(x, w)):
            torch.testing.assert_close(got.torch(), want, atol=1e-5, rtol=1e-5)
    assert sources[7] == sources[33] == sources[130]
    assert all("kiln_size0" in source for source in sources[7])


def _wrapped(n: int) -> Task:
    s = SymSize.named("s0", n)
    x = TensorInput("x", (s,), dtypes.float32)
    return Task("wrapped", [x], [compute((128,), lambda i: x[i % s])])


def test_a_fold_that_holds_at_one_size_only_gives_that_size_its_own_source():
    bodies = {}
    for n in (33, 130, 200):
        task = _wrapped(n)
        x = torch.randn(n)
        torch.testing.assert_close(kiln.graph.run_task(task, kiln.device("cpu"), [x])[0], x[torch.arange(128) % n])
        source = choose(task, "cpu").source
        bodies[n] = source[source.index("void kiln_kernel"):]
    assert "%" in bodies[33] and "%" not in bodies[130]          # i < 128 <= s0: i % s0 is i
    assert bodies[130] == bodies[200] != bodies[33]


def test_bounds_checks_use_the_size_of_the_run():
    def gather(n):
        weight = symbol((SymSize.named("s0", n), 4))
        index = symbol((3,), "int64")
        return trace_from(kiln.ops.embedding(index, weight), [index, weight])

    small, large = gather(7), gather(33)
    assert choose(small.nodes[0].task, "cpu").source == choose(large.nodes[0].task, "cpu").source
    index = torch.tensor([0, 10, 6])
    weight = torch.randn(33, 4)
    torch.testing.assert_close(large(index, weight).torch(), weight[index])
    # the message names the symbolic size, so that the CUDA source (which prints it) is shared too
    with pytest.raises(IndexError, match="index 10 is out of range for a weight of s0 rows"):
        small(index, torch.randn(7, 4))


def test_schedules_that_do_not_take_sizes_get_the_task_specialized():
    task = _wrapped(33)
    fixed = specialize(task)
    assert has_symbolic_sizes(task) and not has_symbolic_sizes(fixed)
    assert fixed.inputs[0].shape == (33,) and type(fixed.inputs[0].shape[0]) is int
    assert specialize(fixed) is fixed and specialize(task) is fixed
    x = torch.randn(33)
    torch.testing.assert_close(kiln.graph.run_task(fixed, kiln.device("cpu"), [x])[0], x[torch.arange(128) % 33])
    assert not any(isinstance(e, SizeVar) for e in _walk_all(fixed))


def _walk_all(task: Task):
    from kiln.ir.compute import Compute
    from kiln.ir.expr import walk
    return [e for node in task.nodes() if isinstance(node, Compute) for e in walk(node.value)]


def test_size_expressions_are_ir_expressions():
    s = SymSize.named("s0", 7)
    e = ((s * 3 + 5) // 4).size_expr()
    assert isinstance(e, Binary) and _value(e) == (7 * 3 + 5) // 4
