"""Zero channels computed by the convolution: where a channels-last tensor gets zero channels
appended (layout planning pads a convolution's input to a multiple of 8 channels) and it is a
convolution's output through element-wise operators that keep zeros zero, the convolution
computes the extra channels itself. Its weight gets zero filters and its bias zeros, each
per-channel constant of the chain zeros, and the pad goes: one kernel fewer (squeeze-and-
excitation's reduced channels in EfficientNet, 6 padded to 8 after the first 1x1 convolution
and its SiLU).

The chain's operators are activations with f(0) = 0 (`ZERO_KEEPING`), casts, and products,
sums and differences whose other operands are constants that vary along the channels only
(padded with zeros; a product may also take a number). Every tensor of the chain has no other
reader, and the convolution is ungrouped with constant weight and bias.
"""
from __future__ import annotations

import torch

from kiln.passes.edit import arguments_of, producer, rebuild, reapply, users
from kiln.passes.graph_pass import GraphPass
from kiln.passes.layout import appended_zero_channels
from kiln.tensor import Tensor, from_torch

ZERO_KEEPING = frozenset({"relu", "relu6", "silu", "gelu", "tanh", "hardswish", "leaky_relu", "elu", "selu",
                          "celu", "mish", "neg", "cast"})
ARITHMETIC = frozenset({"mul", "add", "sub"})


def _per_channel(v, channels: int) -> bool:
    """Whether `v` is a constant that broadcasts against the data along the channels only."""
    return (isinstance(v, Tensor) and not v.is_symbolic and v.ndim >= 1 and v.shape[-1] == channels
            and all(n == 1 for n in v.shape[:-1]))


def _chain_operand(node, channels: int) -> Tensor | None:
    """The input carrying the chain's value into `node`, where `node` keeps zeros zero once its
    per-channel constants are padded with zeros; else None."""
    data = [t for t in node.inputs if t.is_symbolic]
    if len(data) != 1 or data[0].ndim != 4 or data[0].shape[-1] != channels:
        return None
    name = node.definition.name
    if name in ZERO_KEEPING:
        return data[0]
    if name not in ARITHMETIC:
        return None
    others = [v for k, v in arguments_of(node).items() if k != "alpha" and v is not data[0]]
    number = lambda v: isinstance(v, (int, float)) or (isinstance(v, Tensor) and not v.is_symbolic and v.numel() == 1)
    if all(_per_channel(v, channels) or (name == "mul" and number(v)) for v in others):
        return data[0]
    return None


def _with_zeros(t: Tensor, extra: int, dim: int) -> Tensor:
    """Constant `t` with `extra` zeros appended along `dim`."""
    value = t.torch()
    shape = list(value.shape)
    shape[dim] = extra
    return from_torch(torch.cat([value, value.new_zeros(shape)], dim))


def _widened(node, value: Tensor, operand: Tensor, channels: int, extra: int) -> Tensor:
    """`node` re-applied to `value` (`extra` channels wider) in place of `operand`, its
    per-channel constants (a convolution's weight and bias) padded with zeros to match."""
    if node.definition.name == "conv2d_channels_last":
        inputs = [operand] + [_with_zeros(t, extra, 0) for t in node.inputs[1:]]
    else:
        inputs = [value if t is operand else _with_zeros(t, extra, t.ndim - 1) if _per_channel(t, channels) else t
                  for t in node.inputs]
    return reapply(node, inputs)[0]


def _chain(end: Tensor, readers: dict) -> list | None:
    """The nodes from a convolution to `end` (the convolution first) whose zero channels the
    convolution can compute, or None."""
    chain, t, channels = [], end, end.shape[-1]
    while (node := producer(t)) is not None and len(readers.get(id(t), ())) == 1:
        chain.append(node)
        if node.definition.name == "conv2d_channels_last":
            args = arguments_of(node)
            constant = all(not v.is_symbolic for v in node.inputs[1:])
            return chain[::-1] if args["groups"] == 1 and constant else None
        t = _chain_operand(node, channels)
        if t is None:
            return None
    return None


class ZeroFilters(GraphPass):
    """Let convolutions compute the zero channels a pad appends after them (module docs)."""

    name = "zero_filters"
    opt_level = 1
    stage = "layout"        # after layout planning, which appends the zero channels

    def transform(self, graph, ctx):
        readers = users(graph)
        chains = {id(n): c for n in graph.nodes
                  if appended_zero_channels(n) and (c := _chain(n.inputs[0], readers))}
        if not chains:
            return graph
        data = {}           # each convolution's data input in the rebuilt graph

        def rewrite(node, inputs):
            if node.definition.name == "conv2d_channels_last":
                data[id(node)] = inputs[0]
            if id(node) not in chains:
                return None
            # the chain's other operands are constants, kept by the rebuild: its nodes re-apply as they are
            chain, channels, value = chains[id(node)], node.inputs[0].shape[-1], None
            for p in chain:
                operand = data[id(p)] if value is None else _chain_operand(p, channels)
                value = _widened(p, value, operand, channels, appended_zero_channels(node))
            return [value]

        return rebuild(graph, rewrite)
