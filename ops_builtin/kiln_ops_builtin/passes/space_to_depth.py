"""Strided convolutions of few channels as stride-1 convolutions of space-to-depth data.

A channels-last convolution of stride (sh, sw) reads its input in cells of sh x sw pixels.
Stack each cell's pixels as channels and the convolution has stride 1:

    conv(x, W, stride)[b, y, x, o] = conv(x', W')[b, y, x, o]
    x'[b, Y, X, (dy, dx, c)] = x_padded[b, sh Y + dy, sw X + dx, c]
    W'[o, ky, kx, (dy, dx, c)] = W[o, sh ky + dy, sw kx + dx, c]    (zero past the kernel)

Its kernel is ceil(kh / sh) x ceil(kw / sw) taps. A template's GEMM reduces over taps times
channels, the channels padded to a multiple of 8 (`layout.padded_channels`). Where the input
has few channels (a network's first layer: 3, padded to 8), that padding wastes most of K, and
the stacked channels waste less:

- ResNet's 7 x 7 stem at stride 2: K 49 x 8 = 392 becomes 16 x 16 = 256;
- ViT's 16 x 16 patches at stride 16: K 2048 becomes 768, a 1 x 1 convolution (a plain GEMM).

A convolution is rewritten only where K drops to at most MAX_K_RATIO of its size, so a 3 x 3
stem at stride 2 (72 -> 64) is not. The input's rearrangement is views (a pad, reshapes, a
permute) that fusion puts into the kernel that already converts the input to channels-last. The
weight is rearranged here, once. Runs after layout planning and before `zero_filters`; the
convolution must be ungrouped, undilated, with a constant weight and static height and width.
It is also skipped where the cells would need the input cut short (a last partial cell the
convolution never reads).
"""
from __future__ import annotations

import torch

from kiln.passes.edit import arguments_of, producer, rebuild
from kiln.passes.graph_pass import GraphPass
from kiln.passes.layout import appended_zero_channels, int_pair, padded_channels
from kiln.passes.provided import provided
from kiln.tensor import from_torch

MAX_K_RATIO = 0.8
OPERATORS_USED = ("conv2d_channels_last", "pad", "reshape", "permute")


def _cells(t, sh: int, sw: int):
    """Channels-last `t` (height and width multiples of sh and sw) with each sh x sw cell's
    pixels stacked as channels, (dy, dx, c) in that order."""
    n, h, w, c = t.shape
    ops = {name: provided(name) for name in ("reshape", "permute")}
    t = ops["reshape"](t, [n, h // sh, sh, w // sw, sw, c])
    t = ops["permute"](t, [0, 1, 3, 2, 4, 5])
    return ops["reshape"](t, [n, h // sh, w // sw, sh * sw * c])


def _stacked_weight(weight: torch.Tensor, sh: int, sw: int) -> torch.Tensor:
    """(O, kh, kw, C) weights as W' of the module docs, channels padded to a multiple of 8."""
    o, kh, kw, c = weight.shape
    rows, cols = -(-kh // sh), -(-kw // sw)
    w = torch.nn.functional.pad(weight, (0, 0, 0, cols * sw - kw, 0, rows * sh - kh))
    w = w.reshape(o, rows, sh, cols, sw, c).permute(0, 1, 3, 2, 4, 5).reshape(o, rows, cols, sh * sw * c)
    return torch.nn.functional.pad(w, (0, padded_channels(sh * sw * c) - sh * sw * c)).contiguous()


def stacked(node, inputs):
    """conv2d_channels_last `node` (on its rebuilt `inputs`) as a stride-1 convolution of
    space-to-depth data, or None where the module docs say it stays."""
    args = arguments_of(node)
    x, weight = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    (sh, sw), (ph, pw) = int_pair(args["stride"]), int_pair(args["padding"])
    if (args["groups"] != 1 or int_pair(args["dilation"]) != (1, 1) or (sh, sw) == (1, 1) or weight.is_symbolic
            or not all(type(d) is int for d in x.shape[1:])):
        return None
    padding = producer(x)
    data = padding.inputs[0] if padding is not None and appended_zero_channels(padding) else x
    _, h, w, c = data.shape
    _, kh, kw, _ = weight.shape
    rows, cols, cell_channels = -(-kh // sh), -(-kw // sw), sh * sw * c
    if rows * cols * padded_channels(cell_channels) > MAX_K_RATIO * kh * kw * padded_channels(c):
        return None
    oh, ow = node.outputs[0].shape[1:3]
    bottom, right = sh * (oh - 1 + rows) - h - ph, sw * (ow - 1 + cols) - w - pw
    if bottom < 0 or right < 0:
        return None
    if (ph, bottom, pw, right) != (0, 0, 0, 0):
        data = provided("pad")(data, [0, 0, pw, right, ph, bottom])
    cells = _cells(data, sh, sw)
    if padded_channels(cell_channels) > cell_channels:
        cells = provided("pad")(cells, [0, padded_channels(cell_channels) - cell_channels])
    w2 = from_torch(_stacked_weight(weight.torch()[..., :c], sh, sw))
    tf32 = {"allow_tf32": True} if node.attrs.get("allow_tf32") else {}     # the permission stays
    return [provided("conv2d_channels_last")(cells, w2, bias, 1, 0, 1, 1, **tf32)]


class SpaceToDepth(GraphPass):
    """Rewrite strided convolutions of few channels as stride-1 ones (module docs)."""

    name = "space_to_depth"
    opt_level = 1
    stage = "layout"        # the convolutions are channels-last, their inputs padded, then

    def transform(self, graph, ctx):
        if any(provided(name) is None for name in OPERATORS_USED):
            return graph
        if not any(n.definition.name == "conv2d_channels_last" for n in graph.nodes):
            return graph
        return rebuild(graph, lambda node, inputs: stacked(node, inputs)
                       if node.definition.name == "conv2d_channels_last" else None)
