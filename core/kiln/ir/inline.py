"""Inlining of injective computes: the first step of every schedule.

A compute that reduces, or that is an output of the task, is *materialized* (written to a
buffer). Every other compute is injective and is substituted into its consumers, so a chain of
element-wise operators becomes one expression.

A 16-bit float compute that is inlined keeps its float32 value where its consumer reads it as
float32 (`float32_reads`): a chain of bfloat16 element-wise operators (GELU's tanh form and its
gradient, under autocast) computes in float32 and rounds once, where it is stored, as
torch.compile's Inductor does, instead of once per operator as eager PyTorch does. What is
stored keeps its type; reductions (argmin/argmax too), comparisons, isnan/isinf and conversions
to integers read values rounded after every operator, as eager's, so that a maximum and an
equality test against it (a pool's or an argmax's gradient) see the same numbers, a float16
overflow is still seen and a bin or an index computed in 16-bit arithmetic (histc) is eager's;
and a compute that is written to a buffer is read back rounded.
"""
from __future__ import annotations

from typing import Callable, Sequence

from kiln import dtypes
from kiln.ir.compute import Compute, Task, TensorInput, TensorNode, reachable
from kiln.ir.expr import Binary, Cast, Expr, Load, Reduce, Unary, Var
from kiln.ir.opcodes import COMPARISONS, UnaryOp
from kiln.ir.rewrite import rewrite
from kiln.ir.row_stores import RowStore, computed_outputs, row_stores
# Re-exported: kiln.schedule's rewriters import them from here (they belong to kiln.ir.rewrite).
from kiln.ir.rewrite import own_children, rebuild_expr  # noqa: F401,E402
from kiln.ir.simplify import simplify


def substitute(expr: Expr, mapping: dict[int, Expr], memo: dict | None = None,
               loads: dict[int, TensorNode] | None = None) -> Expr:
    """Replace variables (by id) with expressions and, if given, loaded tensors (by id).

    A reduction axis whose extent is an expression gets a new axis of the rewritten extent, once:
    copies of a reduction (as simplification leaves in two index expressions) share its axis
    and parts of its body, which are rewritten once (`memo`) and read that one new axis."""
    mapping = dict(mapping)
    loads = loads or {}
    memo = {} if memo is None else memo
    renamed: dict[int, Var] = {}

    def axis(a: Var) -> Var:
        if id(a) not in renamed:
            renamed[id(a)] = Var(a.name, rewrite(a.extent, post, pre, memo))
            mapping[id(a)] = renamed[id(a)]
        return renamed[id(a)]

    def pre(e: Expr) -> Expr | None:
        if isinstance(e, Var):
            return mapping.get(id(e), e)
        if isinstance(e, Reduce) and any(isinstance(a.extent, Expr) for a in e.axes):
            axes = [axis(a) if isinstance(a.extent, Expr) else a for a in e.axes]
            return Reduce(e.op, axes, rewrite(e.body, post, pre, memo), e.dtype)
        return None

    def post(e: Expr) -> Expr:
        if isinstance(e, Load) and id(e.tensor) in loads:
            return Load(loads[id(e.tensor)], e.indices)
        return e

    return rewrite(expr, post, pre, memo)


TESTS = frozenset({UnaryOp.ISNAN, UnaryOp.ISINF})       # predicates that read rounded values, as comparisons


def unrounded(value: Expr) -> Expr | None:
    """The float32 expression `value` rounds to a 16-bit float, where `value` is that rounding."""
    if isinstance(value, Cast) and value.dtype in dtypes.HALF_FLOATS and value.a.dtype == dtypes.float32:
        return value.a
    return None


def float32_reads(inlined_value: Callable[[Load], Expr | None], plain: Callable[[Expr], Expr]
                  ) -> Callable[[Expr], Expr | None]:
    """A `pre` rewriter (see `kiln.ir.rewrite`) for an inliner: `Cast(Load(c), float32)`, where
    `inlined_value(load)` gives the inlined value of the 16-bit compute `c` at the load's index
    (None where `c` is not inlined) and that value rounds a float32 expression, becomes that
    expression. A reduction, a comparison, isnan/isinf and a conversion to an integer or bool
    are rewritten by `plain`, the inliner without this rule anywhere below (each operator's
    rounding kept, as eager computes), so that they decide on eager's values (see the module
    doc)."""
    def pre(e: Expr) -> Expr | None:
        if (isinstance(e, Reduce) or (isinstance(e, Binary) and e.op in COMPARISONS)
                or (isinstance(e, Unary) and e.op in TESTS) or (isinstance(e, Cast) and not e.dtype.is_float)):
            return plain(e)
        if isinstance(e, Cast) and e.dtype == dtypes.float32 and isinstance(e.a, Load) and e.a.dtype in dtypes.HALF_FLOATS:
            value = inlined_value(e.a)
            return None if value is None else unrounded(value)
        return None
    return pre


class Lowered:
    """A task after inlining: materialized computes in order, each reading only task inputs
    and earlier materialized computes. An output the task stores rows into
    (`kiln.ir.row_stores`) is its compute as the task has it, and no buffer."""

    def __init__(self, task: Task, buffers: Sequence[Compute], outputs: Sequence[Compute]):
        self.task = task
        self.inputs: list[TensorInput] = list(task.inputs)
        self.buffers = list(buffers)
        self.outputs = list(outputs)

    @property
    def temporaries(self) -> list[Compute]:
        outs = {id(o) for o in self.outputs}
        return [b for b in self.buffers if id(b) not in outs]

    @property
    def stores(self) -> tuple[RowStore, ...]:
        """The task's row stores (`kiln.ir.row_stores`): positions among `outputs`."""
        return row_stores(self.task)


def inline_task(task: Task, materialize: Sequence[TensorNode] = ()) -> Lowered:
    """Inline every injective, non-output compute of `task`; simplify the index arithmetic.
    Outputs the task stores rows into (`kiln.ir.row_stores`) are not computed."""
    stored = {s.output for s in row_stores(task)}
    keep = {id(o) for o in task.outputs} | {id(m) for m in materialize}
    inlined: dict[int, Compute] = {}   # original materialized compute -> rewritten one
    buffers: list[Compute] = []

    def inlined_loads(e: Expr) -> Expr:
        """A load of an injective compute becomes its (already rewritten) value."""
        if not isinstance(e, Load):
            return e
        t = e.tensor
        if isinstance(t, Compute) and id(t) not in inlined:
            return substitute(injective[id(t)], {id(a): i for a, i in zip(t.axes, e.indices)})
        return Load(inlined[id(t)], e.indices) if id(t) in inlined else e

    injective: dict[int, Expr] = {}
    chain: list[Compute] = []           # the injective computes, in order
    plain: dict[int, Expr] = {}         # their values with every rounding (for `float32_reads`' plain)
    memo: dict = {}

    def plain_loads(e: Expr) -> Expr:
        if isinstance(e, Load) and isinstance(e.tensor, Compute) and id(e.tensor) in plain:
            t = e.tensor
            return substitute(plain[id(t)], {id(a): i for a, i in zip(t.axes, e.indices)})
        return inlined_loads(e)

    def plain_value(e: Expr) -> Expr:
        for node in chain[len(plain):]:             # in order: each reads earlier ones only
            plain[id(node)] = rewrite(node.value, plain_loads)
        return rewrite(e, plain_loads)

    def inlined_value(load: Load) -> Expr | None:
        t = load.tensor
        if not (isinstance(t, Compute) and id(t) in injective):
            return None
        indices = [rewrite(i, inlined_loads, wide, memo) for i in load.indices]
        return substitute(injective[id(t)], {id(a): i for a, i in zip(t.axes, indices)})

    wide = float32_reads(inlined_value, plain_value)
    for node in (reachable(computed_outputs(task)) if stored else task.nodes()):
        if not isinstance(node, Compute):
            continue
        memo = {}
        value = rewrite(node.value, inlined_loads, wide, memo)
        if id(node) in keep or node.has_reduce:
            new = Compute(node.name, node.axes, simplify(value))
            inlined[id(node)] = new
            buffers.append(new)
        else:
            injective[id(node)] = value
            chain.append(node)
    outputs = []
    for k, out in enumerate(task.outputs):
        if k in stored:
            outputs.append(out)
            continue
        if isinstance(out, TensorInput):
            raise ValueError(f"task '{task.name}' returns its input '{out.name}' unchanged; "
                             "an operator's outputs must be computed")
        outputs.append(inlined[id(out)])
    return Lowered(task, buffers, outputs)
