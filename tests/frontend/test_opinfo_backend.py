"""PyTorch's OpInfo samples, through torch.compile(backend="kiln"), for every op with a rule.

For each OpInfo whose function (or Tensor method) has a mapping rule, the first samples of
float32 on the CPU run through the backend with fullgraph=True and are compared with eager.
Samples whose features are out of scope are skipped with a reason, and counted. At least 95%
of the samples run must match; the summary line prints the pass rate and the op count.
"""
from collections import Counter

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import kiln
from kiln.frontend.torch import kiln_backend, mapping_registry

SAMPLES_PER_OP = 6
PASS_RATE = 0.95


def _mapped_callable(op):
    """The variant of an OpInfo that a rule maps: its function, else its Tensor method."""
    registry = mapping_registry()
    if registry.has("function", op.op):
        return op.op
    method = op.method_variant
    if method is not None and registry.has("method", method.__name__):
        return method
    return None


UNDEFINED_VALUES = ("empty", "empty_like", "new_empty")


def _out_of_scope(op, sample) -> str | None:
    """Why a sample is out of scope for an inference compiler (None if it is in scope)."""
    tensors = [sample.input, *sample.args, *sample.kwargs.values()]
    flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
    if op.name in UNDEFINED_VALUES:
        return "uninitialized values"
    if sample.kwargs.get("return_indices") or ("adaptive_max_pool" in op.name and
                                               sample.args[1:2] == (True,)):
        return "pooling indices (for training)"
    if sample.kwargs.get("training"):
        return "training-mode normalization"
    if "out" in sample.kwargs:
        return "writes into out="
    if any(isinstance(t, torch.Tensor) and t.is_complex() for t in flat):
        return "complex tensor"
    return None


def _run_sample(fn, sample):
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return kiln_backend(gm, example_inputs)

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    torch._dynamo.reset()
    with torch.no_grad():
        expected = call(sample.input, *sample.args, **sample.kwargs)
        actual = torch.compile(call, backend=backend, fullgraph=True, dynamic=False)(
            sample.input, *sample.args, **sample.kwargs)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4, equal_nan=True)


def test_opinfo_samples_match_eager():
    results, skipped, failures, ops = Counter(), Counter(), [], set()
    for op in op_db:
        fn = _mapped_callable(op)
        if fn is None or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        ops.add(op.full_name if hasattr(op, "full_name") else op.name)
        for k, sample in enumerate(op.sample_inputs("cpu", torch.float32)):
            if k == SAMPLES_PER_OP:
                break
            reason = _out_of_scope(op, sample)
            if reason:
                skipped[reason] += 1
                continue
            try:
                _run_sample(fn, sample)
                results["pass"] += 1
            except Exception as exc:  # each failing sample is counted, and listed below
                results["fail"] += 1
                failures.append(f"{op.name}{op.variant_test_name and '.' + op.variant_test_name}: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    total = results["pass"] + results["fail"]
    rate = results["pass"] / total
    print(f"\nOpInfo: {results['pass']}/{total} samples match eager ({rate:.1%}) over {len(ops)} ops; "
          f"skipped: {dict(skipped) or 'none'}")
    print("\n".join(failures))
    assert rate >= PASS_RATE, "\n".join(failures)
