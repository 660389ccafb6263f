"""nn.LSTM and nn.GRU trained through AOTAutograd and Kiln (Kiln's decompositions of aten.lstm /
aten.gru): the output, the final states and every gradient (input, initial states, weights)
against eager. Tolerances as in tests/frontend/test_recurrent.py, a little wider for float32
gradients, which sum over every time step."""
import copy

import pytest
import torch
from torch import nn
from torch._C import DispatchKey
from torch._decomp.decompositions import lstm_impl

# slow: an unrolled recurrence is many small kernels, each built (and NVRTC-checked) cold in CI
pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), pytest.mark.slow]


def _compare(layer, x, states, input_grad: bool, tol):
    """Forward and backward of `layer` (a copy) compiled by Kiln and eagerly, the loss weighing
    every output by fresh random values."""
    results = []
    for compiled in (True, False):
        model = copy.deepcopy(layer)
        leaves = [t.detach().clone().requires_grad_(input_grad) for t in (x, *states)]
        x_, *states_ = leaves
        call = (lambda x, *s: model(x, (s[0], s[1]) if len(s) == 2 else s[0])) if states_ else model
        if compiled:
            call = torch.compile(call, backend="kiln", fullgraph=True)
        with torch._dynamo.config.patch(allow_rnn=True):
            output, final = call(x_, *states_)
        outputs = (output, *(final if isinstance(final, tuple) else (final,)))
        torch.manual_seed(1)
        sum((o * torch.randn(o.shape, dtype=o.dtype)).sum() for o in outputs).backward()
        grads = [t.grad for t in leaves if input_grad] + [p.grad for p in model.parameters()]
        results.append((outputs, grads))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, **tol)
    assert all(g is not None for g in got_grads) and len(got_grads) == len(want_grads)
    torch.testing.assert_close(got_grads, want_grads, **tol)


def test_lstm_projected_batch_first_input_without_grad():
    """The input needs no gradient (a batch of data): torch's own decomposition, a Python
    kernel above autograd, would call mkldnn_rnn_layer here, which Kiln does not map; Kiln's
    takes its place while Kiln traces, and torch's is back after."""
    torch.manual_seed(0)
    layer = nn.LSTM(5, 6, batch_first=True, proj_size=3)
    x = torch.randn(2, 3, 5).transpose(0, 1)      # (batch 3, seq 2, 5), non-contiguous
    _compare(layer, x, (), input_grad=False, tol=dict(atol=5e-5, rtol=1e-4))
    assert torch.ops.aten.lstm.input.py_kernels[DispatchKey.Autograd] is lstm_impl


def test_gru_bidirectional_without_bias_float64_with_states():
    torch.manual_seed(0)
    layer = nn.GRU(3, 4, num_layers=2, bidirectional=True, bias=False).double()
    x, h0 = torch.randn(3, 2, 3, dtype=torch.float64), torch.randn(4, 2, 4, dtype=torch.float64)
    _compare(layer, x, (h0,), input_grad=True, tol=dict(atol=1e-12, rtol=1e-12))


def test_lstm_dropout_between_layers_in_training():
    """Train mode with dropout 1.0 between layers: eager zeroes the first layer's output, so
    the second layer sees zeros (torch's decomposition forgets that dropout); with the
    initial states given, batch 1 and one time step."""
    torch.manual_seed(0)
    layer = nn.LSTM(4, 5, num_layers=2, dropout=1.0).train()
    x, h0, c0 = torch.randn(1, 1, 4), torch.randn(2, 1, 5), torch.randn(2, 1, 5)
    _compare(layer, x, (h0, c0), input_grad=True, tol=dict(atol=5e-5, rtol=1e-4))


def test_overlapping_traces_restore_torchs_kernels_when_the_last_ends():
    """Two traces open at once (threads): the first to end leaves Kiln's decomposition in place
    for the other; torch's kernel is back when both ended."""
    from kiln.frontend.torch.training import plugins_decompose_first
    kernels = torch.ops.aten.lstm.input.py_kernels
    first, second = plugins_decompose_first(), plugins_decompose_first()
    first.__enter__()
    second.__enter__()
    assert kernels[DispatchKey.Autograd] is not lstm_impl
    first.__exit__(None, None, None)
    assert kernels[DispatchKey.Autograd] is not lstm_impl
    second.__exit__(None, None, None)
    assert kernels[DispatchKey.Autograd] is lstm_impl
