"""Dead-code elimination: drop every node no graph output depends on."""
from kiln.graph import trace_from
from kiln.passes.graph_pass import GraphPass


class EliminateDeadCode(GraphPass):
    """Keep only the nodes the outputs depend on (inputs and their order are kept)."""

    name = "eliminate_dead_code"
    opt_level = 0

    def transform(self, graph, ctx):
        return trace_from(graph.outputs, graph.inputs)
