"""Kiln's decompositions of the recurrent layers' ATen ops (lstm, gru, rnn_tanh, rnn_relu on
padded input) in training graphs, in place of torch's: the recurrence of
`kiln_mappings_builtin.recurrence`, in torch operations.

torch's own decompositions do not suit: the LSTM's picks `mkldnn_rnn_layer` (an op with no
Kiln rule) where the input needs no gradient, and every one drops the dropout between layers in
training, which eager applies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.frontend.torch import register_decomposition
from kiln_mappings_builtin.recurrence import Primitives, states, unroll

from kiln_mappings_aten.common import aten

TORCH = Primitives.of(torch, linear=F.linear, dropout=lambda x, p: torch.dropout(x, p, True))


def _decomposition(cell: str):
    def decomposition(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                      batch_first):
        output, finals = unroll(cell, TORCH, input, states(cell, hx), params, has_biases,
                                num_layers, dropout, train, bidirectional, batch_first)
        return (output, *finals)
    decomposition.__name__ = decomposition.__qualname__ = cell
    return decomposition


lstm = register_decomposition(aten.lstm.input)(_decomposition("lstm"))
gru = register_decomposition(aten.gru.input)(_decomposition("gru"))
rnn_tanh = register_decomposition(aten.rnn_tanh.input)(_decomposition("rnn_tanh"))
rnn_relu = register_decomposition(aten.rnn_relu.input)(_decomposition("rnn_relu"))
