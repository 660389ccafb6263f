"""Constant folding: every node computed from constants alone runs once, at optimize time.

Weight transposes, reshapes and casts of parameters, and whatever a rewrite pattern computes
from parameters, become constants of the optimized graph. The kernels run on the constants'
own device.
"""
from kiln.graph import Operator
from kiln.passes.edit import rebuild
from kiln.passes.graph_pass import GraphPass


def _run(node: Operator, inputs):
    if any(t.is_symbolic for t in inputs):
        return None
    return Operator(node.definition, inputs, node.attrs, node.task, node.device).outputs


class FoldConstants(GraphPass):
    """Replace each node whose inputs are all constants by its computed outputs."""

    name = "fold_constants"
    opt_level = 1

    def transform(self, graph, ctx):
        return rebuild(graph, _run)
