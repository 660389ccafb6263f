"""Recomputation: a cheap element-wise value that several kernels read is computed inside each.

Fusion (`kiln.passes.fusion`) gives every tensor with several readers its own kernel, which
writes it to memory for the readers to load. Where the tensor is cheap to compute from what it
reads (casts, a subtraction of a broadcast mean, a ReLU mask: the batch-norm and ReLU
gradients of a training step, say), each reader can compute it from those inputs instead, and
the write and its reads disappear. A node is recomputed by each of its k readers when:

- it is injective, not a reduction and no template schedules it, with one output that is not a
  graph output, and is not `expensive` (a random draw);
- no reader is an operator that a template schedules on some target (templates read plain
  inputs; where the auto-scheduler takes it instead, as for a convolution on the CPU, it reads
  each input element many times), and the node is not the only reader of a template's output,
  nor of an element-wise chain that is (a convolution's batch norm): it would be that
  template's epilogue, computed once and written for all its readers (EfficientNet's SiLU
  after a batch-normed convolution, read by the squeeze-excite pool and the scaling);
- the k readers reading its full-size inputs (I bytes an element) move no more than writing it
  and reading it k times (O bytes an element) save: (k - 1) I <= (k + 1) O, for k <= MAX_COPIES,
  or for any k where the node widens (I < O: a cast to float32, each copy reading fewer bytes
  than its written value would cost to read). A training backward's convolution whose input
  gradient two batch norms' backwards read (ResNet's first block of each stage: five readers)
  then writes its bfloat16 result, not the float32 cast of it (ResNet-50's at batch 32: 103 MB
  instead of 51 MB, at the backward's peak).

Nothing is copied whose value reaches, through element-wise operators, a reduction of trailing
dims (a softmax or norm statistic): there fusion already makes one row kernel of the producers,
the statistic and its readers. Unless some reader is one that row kernel does not hold: one
that takes part of the value (a gather of one element a row, a slice; or element-wise readers
leading only to such), or one leading only to other reductions (a column sum): the logits that
a log-softmax's statistic reads and whose log-probabilities at the targets a gather reads are
computed in both kernels, not written between them, and so is a norm backward's normalized
input, which its row kernel and the weight's gradient (a sum over the rows) both read.
Readers are counted after their own recomputation, so chains (cast, cast, subtract) are copied
whole, one copy per final reader; fusion then joins each copy to its reader. Views and other
nodes that only move data are copied only within such chains: on their own they are index
arithmetic that fusion already places, and copying them would split multi-output kernels (a
view of a cheap value that a reader takes part of heads such a chain: a reshape after a cast).
"""
from __future__ import annotations

import math

from kiln.graph import Operator, trace_from
from kiln.passes.edit import reapply, users
from kiln.passes.fusion import is_anchor, moves_data
from kiln.passes.graph_pass import GraphPass
from kiln.schedule import AUTO_RULES, CompileSession

MAX_COPIES = 4


def _elements(t) -> int:
    """The number of elements of `t`, a SymSize where its shape is symbolic: the pass only
    compares counts (guards, `kiln.ir.size_reads`)."""
    return math.prod(t.shape)


def _bytes_per_element(node: Operator) -> tuple[int, int]:
    """(bytes an output element reads from full-size inputs, bytes it writes)."""
    out = node.outputs[0]
    size = _elements(out)
    reads = sum(t.dtype.nbytes for t in {id(t): t for t in node.inputs}.values() if _elements(t) == size)
    return reads, out.dtype.nbytes


def _has_templates(node: Operator, session: CompileSession) -> bool:
    """Whether a template schedules `node`'s operator on any target: where one does not here,
    the auto-scheduled kernel still reads each input element many times (a convolution)."""
    return any(session.contributed(node.definition.name, target) for target in AUTO_RULES)


def _row_reduction(node: Operator) -> bool:
    """Whether `node` reduces the trailing dims of an input, keeping the leading ones (a softmax or
    norm statistic): fusion makes its producers and readers one row kernel that computes them
    once a row (`kiln.schedule.rows`)."""
    if node.task.is_injective or len(node.outputs) != 1 or not node.inputs:
        return False
    kept, shape = _elements(node.outputs[0]), tuple(node.inputs[0].shape)
    return any(math.prod(shape[:j]) == kept for j in range(len(shape)))


def _other_reduction(node: Operator) -> bool:
    """Whether `node` reduces, but not as a row statistic (a sum over the rows, of a weight's
    gradient): a kernel of its own, which no row kernel holds."""
    return not node.task.is_injective and not _row_reduction(node)


def _takes_part(reader: Operator, node: Operator) -> bool:
    """Whether `reader` takes part of `node`'s value: it is element-wise and makes fewer
    elements (a gather, a slice), so that it reads only some of them."""
    return reader.task.is_injective and _elements(reader.outputs[0]) < _elements(node.outputs[0])


class RecomputeCheapProducers(GraphPass):
    """Copy cheap element-wise producers into each of their readers (see the module docs)."""

    name = "recompute_cheap_producers"
    opt_level = 1

    def transform(self, graph, ctx):
        readers = users(graph)
        outputs = {id(t) for t in graph.outputs}
        producer = {id(t): n for n in graph.nodes for t in n.outputs}
        templated = {id(n) for n in graph.nodes if _has_templates(n, ctx.session)}
        copies: dict[int, int] = {}        # recomputed node (by id) -> how many copies

        def eligible(node: Operator) -> bool:
            return (len(node.outputs) == 1 and id(node.outputs[0]) not in outputs
                    and not is_anchor(node) and id(node) not in templated
                    and not node.definition.traits.expensive
                    and bool(readers.get(id(node.outputs[0])))
                    and not extends_epilogue(node)
                    and not any(id(u) in templated for u in readers[id(node.outputs[0])]))

        def extends_epilogue(node: Operator) -> bool:
            """Whether `node` is the only reader of a template's output, or of an element-wise
            chain that is: fusion makes it part of that template's epilogue, which writes its
            value once for every reader (no wider than what the template wrote). A template's
            output that the graph returns has no epilogue."""
            for t in node.inputs:
                p = producer.get(id(t))
                if (p is None or id(t) in outputs or len(readers[id(t)]) != 1
                        or node.outputs[0].dtype.nbytes > t.dtype.nbytes):
                    continue
                if id(p) in templated or (p.task.is_injective and not is_anchor(p) and len(p.outputs) == 1
                                          and not moves_data(p) and extends_epilogue(p)):
                    return True
            return False

        def computed_view(node: Operator) -> bool:
            """Whether `node` moves data of a value that a cheap element-wise node computes (a
            cast, then a reshape), which its readers may then compute themselves."""
            p = producer.get(id(node.inputs[0])) if node.inputs else None
            return p is not None and eligible(p) and not moves_data(p)

        to_rows: set[int] = set()      # nodes whose value a reader passes whole to a row reduction
        in_part: set[int] = set()      # nodes whose readers all take part of the value
        apart: set[int] = set()        # nodes whose value reaches only reductions other than rows
        seen_by: dict[int, list] = {}  # copied node -> the readers its copies are for
        for node in reversed(graph.nodes):
            reading = [u for t in node.outputs for u in readers.get(id(t), ())]
            final = [r for u in reading for r in seen_by.get(id(u), [u])]
            part = [r for r in final if _takes_part(r, node) or id(r) in in_part]
            outside = [r for r in final if _other_reduction(r) or id(r) in apart]
            if _row_reduction(node) or (node.task.is_injective and any(
                    id(r) in to_rows and not _takes_part(r, node) for r in final)):
                to_rows.add(id(node))
            if node.task.is_injective and final and len(part) == len(final):
                in_part.add(id(node))
            if node.task.is_injective and final and len(outside) == len(final):
                apart.add(id(node))
            if not eligible(node) or (id(node) in to_rows and not part and not outside):
                continue
            k = sum(copies.get(id(u), 1) for u in reading)
            chained = any(id(u) in copies for u in reading)
            reads, writes = _bytes_per_element(node)
            if (chained or k > 1 and part and computed_view(node)) if moves_data(node) else (
                    (k <= MAX_COPIES or reads < writes) and (chained or k > 1)
                    and (k - 1) * reads <= (k + 1) * writes):
                copies[id(node)] = k
                seen_by[id(node)] = final
        if not copies:
            return graph

        mapping: dict[int, object] = {}

        def value(t, local: dict):
            """`t` for one reader: its own copy (`local`, by tensor id) where `t`'s producer is
            recomputed."""
            p = producer.get(id(t))
            if p is None or id(p) not in copies:
                return mapping.get(id(t), t)
            if id(t) not in local:
                local[id(t)] = Operator(p.definition, [value(i, local) for i in p.inputs], p.attrs,
                                        p.task, p.device).outputs[0]
            return local[id(t)]

        for node in graph.nodes:
            if id(node) in copies:
                continue
            local: dict = {}
            mapping.update(zip(map(id, node.outputs), reapply(node, [value(t, local) for t in node.inputs])))
        return trace_from([mapping.get(id(t), t) for t in graph.outputs], graph.inputs)
