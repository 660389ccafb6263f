"""Common-subexpression elimination: one node for each operator applied to the same inputs."""
from kiln.passes.edit import reapply, rebuild
from kiln.passes.graph_pass import GraphPass


class EliminateCommonSubexpressions(GraphPass):
    """Nodes with the same task (operator, attributes, input types) on the same input tensors
    and device compute the same values: the later ones are replaced by the first."""

    name = "eliminate_common_subexpressions"
    opt_level = 1

    def transform(self, graph, ctx):
        first: dict[tuple, list] = {}

        def dedupe(node, inputs):
            key = (id(node.task), node.device, tuple(id(t) for t in inputs))
            if key not in first:
                first[key] = reapply(node, inputs)
            return first[key]

        return rebuild(graph, dedupe)
