"""nn.LSTM, nn.GRU and nn.RNN in inference graphs against eager: one `torch.lstm` / `torch.gru` /
`torch.rnn_*` node each in a dynamo graph (traced with `torch._dynamo.config.allow_rnn`), and the
modules themselves in symbolic_trace graphs, unrolled by Kiln's rules; what Kiln does not
support says so, or runs in PyTorch under fallback_to_eager.

Tolerances: float32 results differ from eager's by the order of summation of each step's dot
products (tens of terms, a few ulps), which the gates (derivatives at most 1) do not amplify
over these few steps; float64 to 1e-12."""
import pytest
import torch
from torch import nn

from kiln.frontend.torch import dynamo_config, kiln_backend
from kiln.frontend.torch.interpreter import MappingError
from kiln_mappings_builtin import rnn

from frontend_support import Capture, run_traced

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

f32, f64 = torch.float32, torch.float64
TOL = {f32: dict(atol=2e-5, rtol=1e-5), f64: dict(atol=1e-12, rtol=1e-12)}
TARGETS = {nn.LSTM: (torch.lstm,), nn.GRU: (torch.gru,), nn.RNN: (torch.rnn_tanh, torch.rnn_relu)}


class Wrapped(nn.Module):
    """The layer and an op before it in one graph (symbolic_trace cannot take the layer as its
    root), called without initial states."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(torch.tanh(x) * 2)


class WithH(Wrapped):
    def forward(self, x, h):
        return self.layer(torch.tanh(x) * 2, h)


class WithHC(Wrapped):
    def forward(self, x, h, c):
        return self.layer(torch.tanh(x) * 2, (h, c))


def _states(layer, batch: int | None, dtype) -> list:
    """Fresh random initial states of `layer` (h0, and c0 for an LSTM), batched or not."""
    rows = layer.num_layers * (2 if layer.bidirectional else 1)
    sizes = [getattr(layer, "proj_size", 0) or layer.hidden_size]
    if isinstance(layer, nn.LSTM):
        sizes.append(layer.hidden_size)
    return [torch.randn((rows, batch, s) if batch else (rows, s), dtype=dtype) for s in sizes]


CASES = {
    # layer, input shape (None: unbatched), given states, dtype
    "lstm_two_layers_batch_first": (nn.LSTM, dict(input_size=5, hidden_size=7, num_layers=2,
                                                  batch_first=True), (3, 4, 5), True, f32),
    "lstm_bidirectional_projected_no_bias": (nn.LSTM, dict(input_size=5, hidden_size=6, proj_size=3,
                                                           bidirectional=True, bias=False),
                                             (6, 1, 5), False, f32),
    "gru_eval_dropout_seq_1": (nn.GRU, dict(input_size=5, hidden_size=7, num_layers=2, dropout=0.3,
                                            bidirectional=True), (1, 3, 5), True, f32),
    "gru_unbatched_float64": (nn.GRU, dict(input_size=3, hidden_size=4), (5, 3), True, f64),
    "rnn_relu_bidirectional_float64": (nn.RNN, dict(input_size=4, hidden_size=5, num_layers=2,
                                                    nonlinearity="relu", bidirectional=True),
                                       (4, 2, 4), False, f64),
}


def _case(name):
    """The model (the layer in eval mode, with fresh weights), its inputs (non-contiguous x and
    the initial states where given) and the tolerance."""
    cls, kwargs, shape, with_states, dtype = CASES[name]
    torch.manual_seed(0)
    layer = cls(**kwargs).to(dtype).eval()
    x = torch.randn(shape[::-1], dtype=dtype).permute(*reversed(range(len(shape))))
    assert not x.is_contiguous()
    batch = None if len(shape) == 2 else shape[0 if kwargs.get("batch_first") else 1]
    states = _states(layer, batch, dtype) if with_states else []
    return (Wrapped, WithH, WithHC)[len(states)](layer), (x, *states), TOL[dtype]


@pytest.mark.parametrize("name", CASES)
def test_dynamo_graph_holds_one_node_kiln_unrolls(name):
    model, inputs, tol = _case(name)
    capture = Capture()
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        expected = model(*inputs)
        actual = torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    torch.testing.assert_close(actual, expected, **tol)
    targets = TARGETS[type(model.layer)]
    calls = [n for n in capture.graphs[0].graph.nodes if n.op == "call_function" and n.target in targets]
    assert len(calls) == 1


@pytest.mark.parametrize("name", ["lstm_bidirectional_projected_no_bias", "gru_unbatched_float64"])
def test_symbolic_trace_module(name):
    model, inputs, tol = _case(name)
    gm = run_traced(model, *inputs, **tol)
    assert any(n.op == "call_module" and n.target == "layer" for n in gm.graph.nodes)


def _training_dropout():
    torch.manual_seed(0)
    return Wrapped(nn.LSTM(4, 5, num_layers=2, dropout=1.0))


def test_dropout_between_layers_in_training_mode_is_refused_or_left_to_pytorch():
    """Without autograd, a layer in train mode with dropout draws random numbers, which Kiln's
    inference rules do not: the error names the op, its arguments and what is supported;
    under fallback_to_eager it runs in PyTorch (dropout=1.0 makes eager's result certain)."""
    model, x = _training_dropout(), torch.randn(3, 2, 4)
    with torch.no_grad(), torch._dynamo.config.patch(allow_rnn=True):
        expected = model(x)
        with pytest.raises(Exception, match=r"failed on \(float32\[3, 2, 4\](.|\n)*torch\.lstm: "
                           "dropout between layers in training mode"):
            torch.compile(model, backend="kiln", fullgraph=True)(x)
        torch._dynamo.reset()
        dynamo_config.fallback_to_eager(True)
        actual = torch.compile(model, backend="kiln", fullgraph=True)(x)
    torch.testing.assert_close(actual, expected, **TOL[f32])


def test_symbolic_trace_training_dropout_names_the_module():
    model, x = _training_dropout(), torch.randn(3, 2, 4)
    with torch.no_grad(), pytest.raises(MappingError, match="dropout between layers in training mode"):
        kiln_backend(torch.fx.symbolic_trace(model), [x])(x)


def test_packed_sequences_are_refused():
    x = torch.randn(5, 4)
    args = (x, torch.tensor([2, 2, 1]), (torch.randn(1, 2, 3), torch.randn(1, 2, 3)),
            [torch.randn(12, 4), torch.randn(12, 3)], False, 1, 0.0, False, False)
    with pytest.raises(ValueError, match=r"torch\.lstm: packed sequences .* not supported; supported: padded"):
        rnn.lstm(*args)
