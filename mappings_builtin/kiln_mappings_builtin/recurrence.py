"""torch's recurrent layers (LSTM, GRU, Elman RNN with tanh or ReLU) unrolled over time, written
once over a set of primitives: Kiln's operators in the inference rules (`rnn`), torch's in the
training decompositions (kiln-mappings-aten's `rnn`).

The arguments are those of `torch.lstm` / `torch.gru` / `torch.rnn_tanh` / `torch.rnn_relu`
(and of the ATen ops of those names): `params` holds, for each layer and then each direction,
w_ih, w_hh, then b_ih, b_hh where `has_biases`, then LSTM's projection w_hr where it has one.
Each layer and direction projects the inputs of every time step at once (one linear over the
whole sequence), then per step adds the projection of the hidden state and applies the cell.
Between layers, in training, dropout applies to the layer's output as eager does.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence


@dataclass(frozen=True)
class Primitives:
    """The operations the recurrence is written in, with torch's signatures (tensors combine
    with Python's + - *): linear(x, weight, bias or None), split(x, size, dim), chunk(x, chunks,
    dim), cat(tensors, dim), transpose(x, dim0, dim1), sigmoid, tanh, relu, and dropout(x, p) as
    in training (None where the caller refuses dropout beforehand)."""

    linear: Callable
    split: Callable
    chunk: Callable
    cat: Callable
    transpose: Callable
    sigmoid: Callable
    tanh: Callable
    relu: Callable
    dropout: Callable | None = None

    @classmethod
    def of(cls, namespace, **given) -> Primitives:
        """The primitives of `namespace` (a module), by name, except those `given` (and
        dropout, which is None unless given)."""
        names = [f.name for f in fields(cls) if f.name not in given and f.name != "dropout"]
        return cls(**{name: getattr(namespace, name) for name in names}, **given)


def _lstm_cell(p: Primitives, projected, state, w_hh, b_hh, w_hr):
    h, c = state
    i, f, g, o = p.chunk(projected + p.linear(h, w_hh, b_hh), 4, 2)
    c = p.sigmoid(f) * c + p.sigmoid(i) * p.tanh(g)
    h = p.sigmoid(o) * p.tanh(c)
    return (h if w_hr is None else p.linear(h, w_hr, None)), c


def _gru_cell(p: Primitives, projected, state, w_hh, b_hh, w_hr):
    (h,) = state
    x_r, x_z, x_n = p.chunk(projected, 3, 2)
    h_r, h_z, h_n = p.chunk(p.linear(h, w_hh, b_hh), 3, 2)
    reset, update = p.sigmoid(x_r + h_r), p.sigmoid(x_z + h_z)
    new = p.tanh(x_n + reset * h_n)
    return ((h - new) * update + new,)


def _elman_cell(activation: str):
    def cell(p: Primitives, projected, state, w_hh, b_hh, w_hr):
        return (getattr(p, activation)(projected + p.linear(state[0], w_hh, b_hh)),)
    return cell


CELLS = {"lstm": _lstm_cell, "gru": _gru_cell, "rnn_tanh": _elman_cell("tanh"),
         "rnn_relu": _elman_cell("relu")}


def states(cell: str, hx) -> tuple:
    """The initial states as torch's ops take them (an LSTM's pair (h0, c0), another layer's
    h0) as a tuple."""
    return tuple(hx) if cell == "lstm" else (hx,)


def layout(cell: str, params: Sequence, has_biases: bool, num_layers: int, bidirectional: bool):
    """The tensors of `params` per layer and direction, or None where their count does not fit
    (each holds w_ih, w_hh, the biases where `has_biases`, and an LSTM's w_hr if it has one)."""
    groups = num_layers * (2 if bidirectional else 1)
    if groups <= 0 or len(params) % groups:
        return None
    per = len(params) // groups
    if per - (2 if has_biases else 0) not in ((2, 3) if cell == "lstm" else (2,)):
        return None
    return [tuple(params[k * per:(k + 1) * per]) for k in range(groups)]


def _direction(cell: str, p: Primitives, x, state: tuple, weights: tuple, has_biases: bool,
               reverse: bool):
    """One layer in one direction over x (T, B, features): (its outputs (T, B, H), its final
    state), the state holding tensors of shape (1, B, H)."""
    w_ih, w_hh = weights[:2]
    b_ih, b_hh = weights[2:4] if has_biases else (None, None)
    w_hr = weights[-1] if len(weights) in (3, 5) else None
    projected = p.split(p.linear(x, w_ih, b_ih), 1, 0)
    outputs = [None] * len(projected)
    for t in (reversed(range(len(projected))) if reverse else range(len(projected))):
        state = CELLS[cell](p, projected[t], state, w_hh, b_hh, w_hr)
        outputs[t] = state[0]
    return p.cat(outputs, 0), state


def unroll(cell: str, p: Primitives, input, hx: tuple, params: Sequence, has_biases: bool,
           num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool):
    """(output, final states) of the recurrent layer `cell` (a key of CELLS) over `input` of
    shape (T, B, features), or (B, T, features) with `batch_first`: `hx` holds the initial
    states, each of shape (layers * directions, B, size) (h, and c for an LSTM), and so do the
    final states. `params` must fit `layout`."""
    directions = 2 if bidirectional else 1
    weights = layout(cell, params, has_biases, num_layers, bidirectional)
    initial = [p.split(s, 1, 0) for s in hx]
    finals: list[list] = [[] for _ in hx]
    x = p.transpose(input, 0, 1) if batch_first else input
    for layer in range(num_layers):
        outputs = []
        for d in range(directions):
            k = layer * directions + d
            out, state = _direction(cell, p, x, tuple(s[k] for s in initial), weights[k], has_biases,
                                    reverse=d == 1)
            outputs.append(out)
            for final, s in zip(finals, state):
                final.append(s)
        x = outputs[0] if directions == 1 else p.cat(outputs, 2)
        if train and dropout and layer < num_layers - 1:
            x = p.dropout(x, dropout)
    return (p.transpose(x, 0, 1) if batch_first else x), tuple(p.cat(f, 0) for f in finals)
