"""float16 conversion (`use_fp16`): float32 computation runs in float16.

Graph inputs are cast to float16 on entry (by the operator implementing `Role.CAST`), float32
constants converted now, and outputs cast back, so the graph keeps its signature. An operator
whose float16 task would sum or multiply up values in float16 (a reduction, softmax or
normalization statistic that does not accumulate in float32 by itself) keeps running in
float32 unless `use_fp16_reduction` is set; so does one that rejects float16 inputs.
"""
from __future__ import annotations

from kiln import dtypes
from kiln.graph import OperatorError, Role, trace_from
from kiln.ir import Compute, Reduce, ReduceOp
from kiln.ir.expr import walk
from kiln.passes.edit import producer, reapply
from kiln.passes.graph_pass import GraphPass
from kiln.plugins import registry
from kiln.tensor import Tensor, from_torch


def _reduces_in_16bit(tensors) -> bool:
    """Whether a node producing `tensors` sums or multiplies in a 16-bit float type."""
    for node in filter(None, map(producer, tensors)):
        for tn in node.task.nodes():
            if isinstance(tn, Compute) and any(
                    isinstance(e, Reduce) and e.op in (ReduceOp.SUM, ReduceOp.PROD) and e.dtype.is_16bit_float
                    for e in walk(tn.value)):
                return True
    return False


class ConvertToFloat16(GraphPass):
    """Run float32 operators in float16 when the context's config sets `use_fp16`."""

    name = "convert_to_float16"
    opt_level = 0

    def transform(self, graph, ctx):
        if not ctx.session.settings.use_fp16:
            return graph
        keep_reductions = not ctx.session.settings.use_fp16_reduction
        cast = registry().implementing(Role.CAST)
        converted: dict[int, Tensor] = {}

        def to(t: Tensor, dtype) -> Tensor:
            if t.dtype == dtype:
                return t
            if t.is_symbolic:
                return cast(t, dtype.name)
            return from_torch(t.torch().to(dtype.torch_dtype))

        def half(t: Tensor) -> Tensor:
            if t.dtype != dtypes.float32:
                return t
            if id(t) not in converted:
                converted[id(t)] = to(t, dtypes.float16)
            return converted[id(t)]

        mapping: dict[int, Tensor] = {}

        def value(t: Tensor) -> Tensor:
            return mapping[id(t)] if id(t) in mapping else half(t)

        for node in graph.nodes:
            inputs = [value(t) for t in node.inputs]
            try:
                outs = reapply(node, inputs)
            except OperatorError:
                outs = None
            if outs is None or (keep_reductions and _reduces_in_16bit(outs)):
                outs = reapply(node, [to(new, old.dtype) for new, old in zip(inputs, node.inputs)])
            for old, new in zip(node.outputs, outs):
                mapping[id(old)] = half(new)
        outputs = [to(value(t), t.dtype) for t in graph.outputs]
        return trace_from(outputs, graph.inputs)
