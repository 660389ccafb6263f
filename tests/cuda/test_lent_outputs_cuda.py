"""An inference graph's outputs handed out as the CUDA graph's own memory (`CompiledRun`'s
LENDING_CAPTURES): no copy per call, never overwritten while the caller holds them, and a
caller keeping every call's outputs gets copies rather than a capture per call."""
import gc

import pytest
import torch

from kiln.frontend.torch.backend import CompiledRun, KilnFunction

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


def _run(fn) -> CompiledRun:
    gc.collect()
    (run,) = [r for f in KilnFunction.live() for r in f.graphs.values() if r.captures]
    return run


def _layer(x, w):
    return torch.tanh(x @ w) * 2 + 1


def _inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(33, 64, device="cuda", generator=g)


def test_a_loop_alternates_between_two_captures_without_copies():
    w = torch.randn(64, 48, device="cuda")
    f = torch.compile(_layer, backend="kiln")
    addresses = []
    out = None
    for k in range(6):
        x = _inputs(k)
        out = f(x, w)              # the previous `out` is alive during this call
        torch.testing.assert_close(out, _layer(x, w))
        addresses.append(out.data_ptr())
    run = _run(f)
    assert len(run.captures) == CompiledRun.LENDING_CAPTURES + 1, "two lending captures and a copying one"
    assert len(set(addresses)) == 2 and addresses[0::2] == [addresses[0]] * 3, addresses
    lent = {t.data_ptr() for c in run.captures.values() if run._lends_results(c) for t in c.static_outputs}
    assert set(addresses) == lent, "the outputs are the captures' own memory"


def test_outputs_kept_by_the_caller_are_never_overwritten():
    w = torch.randn(64, 48, device="cuda")
    f = torch.compile(_layer, backend="kiln")
    xs = [_inputs(k) for k in range(7)]
    kept = [f(x, w) for x in xs]
    kept_rows = f(xs[0], w)[3]         # a view keeps its output's memory too
    for _ in range(3):
        f(xs[1], w)
    for x, got in zip(xs, kept):
        torch.testing.assert_close(got, _layer(x, w))
    torch.testing.assert_close(kept_rows, _layer(xs[0], w)[3])
    assert len(_run(f).captures) <= CompiledRun.LENDING_CAPTURES + 1, "copying captures after the lending ones"


def test_an_output_fed_back_as_the_next_input():
    w = torch.randn(64, 64, device="cuda") / 8
    f = torch.compile(_layer, backend="kiln")
    h, want = _inputs(0), _inputs(0)
    for _ in range(6):
        h = f(h, w)
        want = _layer(want, w)
        torch.testing.assert_close(h, want)


def test_one_graph_reading_another_graphs_outputs():
    w1, w2 = torch.randn(64, 64, device="cuda") / 8, torch.randn(64, 48, device="cuda")
    f = torch.compile(_layer, backend="kiln")
    g = torch.compile(lambda x, w: torch.relu(x @ w), backend="kiln")
    previous = None
    for k in range(5):
        x = _inputs(k)
        y = f(x, w1)
        z = g(y, w2)
        torch.testing.assert_close(z, torch.relu(_layer(x, w1) @ w2))
        if previous is not None:
            torch.testing.assert_close(previous[1], torch.relu(_layer(previous[0], w1) @ w2))
        previous = (x, z)
