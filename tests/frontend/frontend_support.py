"""Helpers of the frontend tests: compile through backend="kiln" and keep what it built."""
import torch

from kiln.frontend.torch import kiln_backend


class Capture:
    """A torch.compile backend that compiles with Kiln and keeps the graphs and the compiled
    functions (to look inside), counting calls so a test knows Kiln really ran."""

    def __init__(self, **options):
        self.options = options or None
        self.graphs, self.compiled = [], []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        compiled = kiln_backend(gm, example_inputs, options=self.options)
        self.compiled.append(compiled)
        return compiled


def compile_and_compare(model, *inputs, atol=1e-4, rtol=1e-4, **kwargs):
    """Run `model` eagerly and through Kiln (fullgraph); assert the outputs match; return the
    capture and Kiln's output."""
    capture = Capture()
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(*inputs, **kwargs)
        actual = torch.compile(model, backend=capture, fullgraph=True)(*inputs, **kwargs)
    assert capture.compiled, "the Kiln backend was never called"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    return capture, actual


def run_traced(model, *inputs, atol=1e-4, rtol=1e-4):
    """symbolic_trace `model` (a graph of call_module nodes), compile it with the Kiln backend,
    assert it matches eager; return the traced graph."""
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        expected = model(*inputs)
        actual = kiln_backend(gm, list(inputs))(*inputs)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    return gm
