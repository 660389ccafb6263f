"""Recurrent layers in inference graphs: `torch.lstm`, `torch.gru`, `torch.rnn_tanh` and
`torch.rnn_relu` on padded input (what nn.LSTM, nn.GRU and nn.RNN call, one node each in a
dynamo graph traced with `torch._dynamo.config.allow_rnn = True`), and those modules in
symbolic_trace graphs, unrolled over time into Kiln's operators (`recurrence`).

Not supported, with an error saying so (or the node left to PyTorch under fallback_to_eager):
packed sequences, and dropout between layers in training mode (random; supported through
autograd, where kiln-mappings-aten decomposes these ops).
"""
from __future__ import annotations

import torch
from torch import nn

from kiln import ops
from kiln.frontend.torch import KilnModule, register_function, register_module
from kiln.tensor import Tensor

from kiln_mappings_builtin import shape
from kiln_mappings_builtin.recurrence import CELLS, Primitives, layout, states, unroll

SUPPORTED = ("supported: padded input of shape (seq, batch, features) ((batch, seq, features) with "
             "batch_first) of a floating-point dtype, any number of layers, one or two directions, "
             "with or without biases (and an LSTM's projection), dropout between layers in eval mode")


def _kiln() -> Primitives:
    """Kiln's operators (looked up when a rule runs: the operators' plugins load after this
    module), split and chunk giving a tuple for one piece too."""
    return Primitives.of(ops, split=shape.split, chunk=shape.chunk)


def _packed(name: str) -> ValueError:
    return ValueError(f"{name}: packed sequences (PackedSequence, a batch_sizes tensor) are not "
                      f"supported; {SUPPORTED}")


def _recurrent(cell: str, input, hx: tuple, params, has_biases: bool, num_layers: int,
               dropout: float, train: bool, bidirectional: bool, batch_first: bool):
    """(output, final states) in Kiln's operators, after checking what Kiln supports."""
    name = f"torch.{cell}"
    if input.ndim != 3 or not input.dtype.is_float:
        raise ValueError(f"{name}: input {input.signature()} is not supported; {SUPPORTED}")
    if layout(cell, params, has_biases, num_layers, bidirectional) is None:
        raise ValueError(f"{name}: {len(params)} weights do not make {num_layers} layer(s) of "
                         f"{2 if bidirectional else 1} direction(s), has_biases={has_biases}")
    if train and dropout and num_layers > 1:
        raise ValueError(f"{name}: dropout between layers in training mode (dropout={dropout}, "
                         "train=True) draws random numbers, which Kiln's inference rules do not; "
                         f"call model.eval(), or train through autograd; {SUPPORTED}")
    return unroll(cell, _kiln(), input, hx, params, has_biases, num_layers, dropout, train,
                  bidirectional, batch_first)


def _function_rule(cell: str):
    def rule(input, hx, params, has_biases, *rest):
        if isinstance(has_biases, (list, tuple)):     # (data, batch_sizes, hx, params, ...)
            raise _packed(f"torch.{cell}")
        output, finals = _recurrent(cell, input, states(cell, hx), params, has_biases, *rest)
        return (output, *finals)
    rule.__name__ = rule.__qualname__ = cell
    return register_function(getattr(torch, cell))(rule)


lstm, gru, rnn_tanh, rnn_relu = (_function_rule(cell) for cell in CELLS)


@register_module(nn.LSTM, nn.GRU, nn.RNN)
class Recurrent(KilnModule):
    """nn.LSTM, nn.GRU and nn.RNN called on a tensor (batched or not), with or without
    initial states: returns (output, (h_n, c_n)) for an LSTM, (output, h_n) otherwise."""

    def __call__(self, input, hx=None):
        m = self.torch_module
        cell = {nn.LSTM: "lstm", nn.GRU: "gru"}.get(type(m)) or f"rnn_{m.nonlinearity}"
        if not isinstance(input, Tensor):
            raise _packed(type(m).__name__)
        batched = input.ndim != 2
        batch_dim = 0 if m.batch_first else 1
        if not batched:
            input = ops.unsqueeze(input, batch_dim)
        initial = self._initial(cell, input, hx, batched)
        params = [self.param(name) for name in m._flat_weights_names]
        output, finals = _recurrent(cell, input, initial, params, m.bias, m.num_layers, m.dropout,
                                    m.training, m.bidirectional, m.batch_first)
        if not batched:
            output, finals = ops.squeeze(output, batch_dim), tuple(ops.squeeze(s, 1) for s in finals)
        return (output, finals) if cell == "lstm" else (output, finals[0])

    def _initial(self, cell: str, input, hx, batched: bool) -> tuple:
        """The initial states (h, and c for an LSTM), each (layers * directions, batch, size):
        `hx` given, else zeros."""
        m = self.torch_module
        if hx is not None:
            given = states(cell, hx)
            return given if batched else tuple(ops.unsqueeze(s, 1) for s in given)
        rows = m.num_layers * (2 if m.bidirectional else 1)
        batch = input.shape[0 if m.batch_first else 1]
        sizes = (getattr(m, "proj_size", 0) or m.hidden_size, m.hidden_size)[:2 if cell == "lstm" else 1]
        return tuple(ops.full((rows, batch, size), 0, dtype=input.dtype, device=input.device)
                     for size in sizes)
