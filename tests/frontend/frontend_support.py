"""Helpers of the frontend tests: compile through backend="kiln" and keep what it built."""
import logging

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


def greedy_decode(step, prompt, config, builds, steps=32):
    """`steps` greedy tokens after `prompt` over transformers' DynamicCache, `step` being the
    model or its compiled form: (the tokens, the kernels `builds()` counted at each step)."""
    import transformers
    out = step(prompt, past_key_values=transformers.DynamicCache(config=config), use_cache=True)
    tokens, new = [out.logits[:, -1:].argmax(-1)], []
    for _ in range(steps):
        before = builds()
        out = step(tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1:].argmax(-1))
        new.append(builds() - before)
    return [t.item() for t in tokens], new


def fresh_compiles(tmp_path, monkeypatch):
    """For a fixture: an empty kernel cache (so that every build is logged), no NVRTC check of
    CPU builds, dynamo and Kiln's dynamo settings reset before and after."""
    import kiln
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_NVRTC_CHECK", raising=False)
    torch._dynamo.reset()
    yield
    kiln.torch.dynamo_config.reset()
    torch._dynamo.reset()


def kernels_built(caplog, kind: str):
    """A function giving the kernels of `kind` ('cpu', 'cuda') built so far: the kernel cache
    misses the `kiln` logger reported."""
    caplog.set_level(logging.INFO, logger="kiln")
    prefix = f"kernel cache miss: building {kind}/"
    return lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def builds_per_length(model, lengths, builds, device="cpu"):
    """Compile `model` (a transformers causal LM of vocabulary 64) with Kiln, the sequence dim
    marked dynamic at the first length, and call it at batch 2 and each of `lengths` against
    eager: the kernels `builds()` counted at each call."""
    compiled, new = torch.compile(model, backend="kiln"), []
    for k, length in enumerate(lengths):
        ids = torch.randint(0, 64, (2, length), device=device)
        if k == 0:
            torch._dynamo.mark_dynamic(ids, 1)
        before = builds()
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, use_cache=False).logits,
                                       model(ids, use_cache=False).logits, atol=1e-4, rtol=1e-4)
        new.append(builds() - before)
    return new
