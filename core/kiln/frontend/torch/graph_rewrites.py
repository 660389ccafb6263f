"""Rewrites of dynamo graphs before AOTAutograd traces them (`register_graph_rewrite`).

`rewrite_graph(gm)` offers each node that calls a rule's target (a torch function, or a Tensor
method by `torch.Tensor.<name>`) to the rules for it, best first, until one rewrites the graph
around it; nodes an earlier rewrite erased are skipped. A rule works on the node's
neighbourhood (`Node.args`, `Node.users`, the traced values in `meta["example_value"]`) and
replaces uses itself; `constant_value` evaluates a node that no input of the graph reaches (a
mask made from `arange`), for rules that decide by its value.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from kiln.frontend.torch.registry import REWRITE, mapping_registry
from kiln.log import logger


def rewrite_graph(gm: GraphModule) -> int:
    """Apply the graph-rewrite rules in effect to `gm` in place; the number of rewrites."""
    registry = mapping_registry()
    done = 0
    for node in gm.graph.nodes:         # skips the nodes erased on the way
        target = called(node)
        if not node.users or target is None:
            continue
        rule = next((r for r in _rules(registry, target) if r.handler(node)), None)
        if rule is not None:
            done += 1
            logger.debug("graph rewrite %s at node %s", rule.handler.__name__, node.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def called(node: Node):
    """The torch function a node calls, or the Tensor method (`torch.Tensor.<name>`); else None."""
    if node.op == "call_function":
        return node.target
    return getattr(torch.Tensor, node.target, None) if node.op == "call_method" else None


def ancestors(node: Node) -> set[Node]:
    """`node` and every node it is computed from."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def _rules(registry, target) -> list:
    try:
        return registry.candidates(REWRITE, target)
    except TypeError:       # an unhashable target
        return []


def constant_value(node: Node):
    """The value of `node` where the graph computes it from no input, parameter or module
    attribute (only from constants: `arange`, `full`, ...), else None."""
    computed_from = ancestors(node)
    if any(n.op not in ("call_function", "call_method") for n in computed_from):
        return None
    graph, copies = Graph(), {}
    for n in node.graph.nodes:          # in the graph's order: producers first
        if n in computed_from:
            copies[n] = graph.node_copy(n, lambda a: copies[a])
    graph.output(copies[node])
    with torch.no_grad():
        return GraphModule(torch.nn.Module(), graph)()


def erase_unused(nodes) -> None:
    """Erase those of `nodes` left without users, and then their producers among `nodes` that
    this leaves without users."""
    nodes, erased = set(nodes), set()
    pending = list(nodes)
    while pending:
        n = pending.pop()
        if n not in erased and not n.users:
            inputs = n.all_input_nodes
            n.graph.erase_node(n)
            erased.add(n)
            pending.extend(i for i in inputs if i in nodes)
