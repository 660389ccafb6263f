"""16-byte rows for the GPU's tensor-core GEMMs: a 16-bit tensor whose rows are not a multiple of
eight elements, read by several matmuls, padded once with zeros.

The CUDA GEMM templates read their operands through TMA, whose rows must start 16 bytes apart.
An operand that is not so is copied by the GEMM that reads it: staged into a zero-padded
temporary where the GEMM contracts along its rows (`templates.stage`), or transposed into a
buffer of its own where it reads across them. The gradient of an LM head's logits over a
vocabulary of 50,257 words is read both ways, by the input's gradient (d(logits) W) and the
weight's (d(logits)^T h), so GPT-2's backward copied it twice (412 MB each at batch 8, 512
tokens). Here such a tensor t, [..., R, C], is padded once to [..., R, Cp] (Cp: C rounded up to
eight, zeros past C), and each matmul reads the padded tensor:

- one contracting over C (t as its left operand, or t's transpose as its right one) contracts
  over Cp, its other operand padded with zeros along the contraction (the products past C add
  zero): a copy of that operand, which a weight's K-contiguous rows make cheap;
- one reading C as its rows or columns (t's transpose as its left operand, t as its right)
  reads the first C columns of the padded tensor, a view whose rows are 16-byte aligned, which
  the templates read in place.

Applies on CUDA to float16 and bfloat16 tensors that only matmuls read (directly or through a
transpose of their last two dims), at least two of them: with one reader, its own staging copy
costs the same as the pad.
"""
from __future__ import annotations

from kiln import dtypes
from kiln.graph import Operator
from kiln.passes.edit import rebuild, remake, users
from kiln.passes.graph_pass import GraphPass
from kiln.passes.provided import provided
from kiln.tensor import Tensor

ALIGN = 8                   # elements of 16 bits in 16 bytes
DEVICES = ("cuda",)         # the kinds of device whose GEMMs want aligned rows


def _swaps_last_two(node) -> bool:
    """Whether `node` only exchanges its input's last two dims (an operator declaring the trait
    `permutation`, a plain node)."""
    order_of = node.definition.traits.permutation
    if order_of is None or type(node) is not Operator or len(node.inputs) != 1:
        return False
    n = node.inputs[0].ndim
    return n >= 2 and list(order_of(node)) == [*range(n - 2), n - 1, n - 2]


def _reads(t: Tensor, readers: dict) -> list[tuple] | None:
    """How each matmul reads `t`: (matmul, operand position, through a transpose or not), or
    None where anything else reads `t` or its transpose."""
    found = []
    for node in readers.get(id(t), []):
        if node.definition.name == "matmul":
            found += [(node, k, False) for k, x in enumerate(node.inputs) if x is t]
        elif _swaps_last_two(node):
            for m in readers.get(id(node.outputs[0]), []):
                if m.definition.name != "matmul":
                    return None
                found += [(m, k, True) for k, x in enumerate(m.inputs) if x is node.outputs[0]]
        else:
            return None
    return found


def _candidate(t: Tensor, readers: dict) -> list[tuple] | None:
    """The matmul reads of `t` where padding it once pays (see the module doc), else None."""
    if (t.ndim < 2 or t.dtype not in dtypes.HALF_FLOATS or t.device.kind not in DEVICES
            or type(t.shape[-1]) is not int or t.shape[-1] % ALIGN == 0):
        return None
    found = _reads(t, readers)
    matmuls = {id(m) for m, _, _ in found or ()}
    if len(matmuls) < 2 or len(matmuls) < len(found):      # a matmul reading t twice is left alone
        return None
    return found if all(m.inputs[1 - k].ndim >= 2 for m, k, _ in found) else None


class AlignedRows(GraphPass):
    """Pad each 16-bit tensor on CUDA whose rows are not 16-byte multiples, read by two or more
    matmuls, once with zeros, and let those matmuls read the padded tensor (module doc)."""

    name = "aligned_rows"
    opt_level = 1
    stage = "layout"        # the types are final; before fusion, which joins the views to the GEMMs

    def transform(self, graph, ctx):
        pad, slice_, transpose = (provided(n) for n in ("pad", "slice", "transpose"))
        if None in (pad, slice_, transpose):
            return graph
        readers = users(graph)
        tensors = {id(t): t for n in graph.nodes for t in n.inputs}
        rewrites = {}           # matmul id -> (tensor id, operand position, through a transpose)
        for t_id, t in tensors.items():
            reads = _candidate(t, readers)
            if reads is not None and not any(id(m) in rewrites for m, _, _ in reads):
                rewrites.update({id(m): (t_id, k, through) for m, k, through in reads})
        if not rewrites:
            return graph
        padded: dict[int, Tensor] = {}

        def rewrite(node, inputs):
            if id(node) not in rewrites:
                return None
            t_id, k, through = rewrites[id(node)]
            t = tensors[t_id]
            c = t.shape[-1]
            extra = -c % ALIGN
            if t_id not in padded:
                padded[t_id] = pad(t, [0, extra])
            wide = padded[t_id]
            contracts = (k == 0) != through        # C is the reduction dim of this matmul
            source = wide if contracts else slice_(wide, -1, 0, c)
            operands = list(inputs)
            operands[k] = transpose(source, -1, -2) if through else source
            if contracts:
                # the other operand's contraction dim: its second-to-last (right) or last (left)
                operands[1 - k] = pad(inputs[1 - k], [0, 0, 0, extra] if k == 0 else [0, extra])
            return remake(node, operands)

        return rebuild(graph, rewrite)
