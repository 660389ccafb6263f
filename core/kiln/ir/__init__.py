"""The compute IR: scalar expressions, tensor computes, reductions and tasks; rewriting,
simplification and inlining of expressions; index arithmetic; symbolic sizes."""
from kiln.ir.compute import Compute, Task, TensorInput, TensorNode, compute
from kiln.ir.expr import (
    Binary, Cast, Check, Const, Expr, Load, Reduce, Select, SizeVar, Unary, Var, abs_, acos, acosh, as_expr,
    asin, asinh, atan, atan2, atanh, binary, bitwise_and, bitwise_or, bitwise_xor, cast, ceil, check,
    cos, cosh, eq, erf, exp, exp_approx, expm1, floor, fmod, isinf, isnan, log, log1p, log2, logical_and,
    logical_not, logical_or, maximum, minimum, ne, reciprocal_approx, reduce, round_even, rsqrt, select,
    shift_left, shift_right, sign, sin, sinh, sqrt, tan, tanh, trunc, unary,
)
from kiln.ir.index import unravel
from kiln.ir.inline import Lowered, inline_task, substitute
from kiln.ir.opcodes import BinaryOp, ReduceOp, UnaryOp
from kiln.ir.rewrite import own_children, rebuild_expr, rewrite
from kiln.ir.simplify import bounds, simplify
from kiln.ir.size import SymSize, as_dim, as_index, size_key, slice_extent

__all__ = [name for name in dir() if not name.startswith("_")]
