"""Channel gates folded into weights: a 1x1 convolution of gated channels-last data (squeeze-and-
excitation's `x * gate`, the gate one value per batch and channel) becomes a batched matrix
product with weights scaled per batch,

    conv2d_channels_last(x * g, W)[b, h, w, o] = sum_c x[b, h, w, c] * (g[b, c] * W[o, c]),

so the full-size product `x * g` is never written: a small kernel scales the weights (B x O x C
values) and the product reads `x` itself. Where the weights would outweigh the data (O more
than half the pixels: the late 7 x 7 layers), the gate stays. Runs after layout planning (the convolutions are
channels-last then), on graphs that run on a GPU (the CPU's convolutions read weights laid
out once, which per-batch weights would not be), and only where a plugin provides matmul,
reshape, transpose and mul.
"""
from __future__ import annotations

from kiln.passes.graph_pass import GraphPass
from kiln.passes.layout import int_pair
from kiln.passes.pattern import constant, op, rewrite_pattern, wildcard
from kiln.passes.provided import provided
from kiln.passes.subgraph_rewrite import RewriteSubgraphs

_x, _w = wildcard(), constant()
_gate = wildcard(where=lambda t: t.ndim == 4 and t.shape[1:3] == (1, 1))   # one value per batch and channel
_gated = op("mul", _x, _gate, commutative=True)
_conv = op("conv2d_channels_last", _gated, _w)


def _pointwise(args: dict) -> bool:
    """A 1x1 kernel at stride 1, no padding, one group."""
    return (args["weight"].shape[1:3] == (1, 1) and int_pair(args["stride"]) == (1, 1)
            and int_pair(args["padding"]) == (0, 0) and args["groups"] == 1)


@rewrite_pattern("fold_channel_gate", _conv)
def fold_channel_gate(m):
    """conv2d_channels_last(x * g, W, b) with g of shape (B, 1, 1, C): matmul(x, (g W)^T) + b."""
    x, gate, w, args = m[_x], m[_gate], m[_w], m.args(_conv)
    ops = {name: provided(name) for name in ("matmul", "reshape", "transpose", "mul", "add")}
    if (any(f is None for f in ops.values()) or x.ndim != 4 or not _pointwise(args)
            or not all(type(n) is int for n in x.shape)):
        return None
    b, h, wd, c = x.shape
    bias, out = args["bias"], m[_conv].outputs[0]
    if (gate.shape != (b, 1, 1, c) or len({x.dtype, gate.dtype, w.dtype, out.dtype}) != 1
            or (bias is not None and bias.dtype != out.dtype)):
        return None
    o = w.shape[0]
    if 2 * o > h * wd:         # the scaled weights (B x O x C) would outweigh the gated data (B x H W x C)
        return None
    scaled = ops["mul"](ops["reshape"](gate, [b, 1, c]), ops["reshape"](w, [1, o, c]))      # (B, O, C)
    # the convolution's TF32 permission goes to the product computing it
    y = ops["matmul"](ops["reshape"](x, [b, h * wd, c]), ops["transpose"](scaled, 1, 2),       # (B, H W, O)
                      allow_tf32=m[_conv].attrs.get("allow_tf32", False))
    if bias is not None:
        y = ops["add"](y, bias)
    return ops["reshape"](y, [b, h, wd, o])


class FoldChannelGates(GraphPass):
    """Fold the channel gates read by 1x1 convolutions into per-batch weights (module docs)."""

    name = "fold_channel_gates"
    opt_level = 1
    stage = "layout"        # the convolutions are channels-last then

    def transform(self, graph, ctx):
        if not any(n.device.kind == "cuda" for n in graph.nodes):
            return graph
        return RewriteSubgraphs([fold_channel_gate]).transform(graph, ctx)
