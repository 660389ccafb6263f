"""PyTorch's OpInfo samples run through torch.compile(backend="kiln"): shared by the shards of
test_opinfo_backend.py, and runnable alone (`python tests/frontend/opinfo_samples.py`) to print
the numbers over every op."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.testing._internal.common_methods_invocations import op_db

from kiln.frontend.torch import kiln_backend, mapping_registry

SAMPLES_PER_OP = 6
UNDEFINED_VALUES = ("empty", "empty_like", "new_empty", "empty_strided", "empty_permuted")


def float32_ops(*devices: str) -> list:
    """The OpInfos that support float32 on each of `devices` (the CPU when none), in op_db's order."""
    return [op for op in op_db if all(torch.float32 in op.supported_dtypes(d) for d in devices or ("cpu",))]


def mapped_callable(op):
    """The variant of an OpInfo that a rule maps: its function, else its Tensor method."""
    registry = mapping_registry()
    if registry.has("function", op.op):
        return op.op
    method = op.method_variant
    if method is not None and registry.has("method", method.__name__):
        return method
    return None


def out_of_scope(op, sample) -> str | None:
    """Why a sample is out of scope for an inference compiler (None if it is in scope)."""
    tensors = [sample.input, *sample.args, *sample.kwargs.values()]
    flat = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
    if op.name in UNDEFINED_VALUES:
        return "uninitialized values"
    if "adaptive_max_pool" in op.name and (sample.kwargs.get("return_indices")
                                           or sample.args[1:2] == (True,)):
        return "adaptive pooling indices"
    if sample.kwargs.get("training"):
        return "training-mode normalization"
    if "out" in sample.kwargs:
        return "writes into out="
    if any(isinstance(t, torch.Tensor) and t.is_complex() for t in flat):
        return "complex tensor"
    return None


def _real(value):
    if isinstance(value, torch.Tensor) and value.is_complex():
        return torch.view_as_real(value.resolve_conj())
    return value


def run_sample(fn, sample) -> None:
    """Compile `fn` on the sample with fullgraph=True and compare it with eager."""
    def call(*args, **kwargs):      # Kiln returns real tensors: a complex result as its real pairs
        out = fn(*args, **kwargs)
        return tuple(map(_real, out)) if isinstance(out, (tuple, list)) else _real(out)

    torch._dynamo.reset()
    with torch.no_grad():
        expected = call(sample.input, *sample.args, **sample.kwargs)
        actual = torch.compile(call, backend=kiln_backend, fullgraph=True, dynamic=False)(
            sample.input, *sample.args, **sample.kwargs)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4, equal_nan=True)


@dataclass
class Tally:
    """What a run of OpInfo samples gave."""

    ops: int = 0                      # float32 ops looked at
    mapped: int = 0                   # of them, ops with a rule
    clean: int = 0                    # mapped ops whose every sample in scope matches
    passed: int = 0                   # samples that match
    failed: int = 0                   # samples that raise or differ
    skipped: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)
    wrong: list = field(default_factory=list)     # of the failures, the samples whose values differ

    @property
    def rate(self) -> float:
        return self.passed / max(self.passed + self.failed, 1)

    def summary(self) -> str:
        return (f"OpInfo: {self.clean} of {self.ops} float32 ops pass every sample ({self.mapped} mapped); "
                f"{self.passed}/{self.passed + self.failed} samples of mapped ops match ({self.rate:.1%}), "
                f"{len(self.wrong)} with other values; skipped: {dict(self.skipped) or 'none'}")


def run_ops(ops, device: str = "cpu", samples: int = SAMPLES_PER_OP) -> Tally:
    """Run the first `samples` samples on `device` of every op in `ops` that a rule maps. A
    sample whose compiled values differ from eager's (rather than raising) is also listed in
    `Tally.wrong`."""
    tally = Tally()
    for op in ops:
        tally.ops += 1
        fn = mapped_callable(op)
        if fn is None:
            continue
        tally.mapped += 1
        clean = True
        for k, sample in enumerate(op.sample_inputs(device, torch.float32)):
            if k == samples:
                break
            reason = out_of_scope(op, sample)
            if reason:
                tally.skipped[reason] += 1
                continue
            try:
                run_sample(fn, sample)
                tally.passed += 1
            except Exception as exc:  # each failing sample is counted, and listed
                clean = False
                tally.failed += 1
                line = (f"{op.name}{op.variant_test_name and '.' + op.variant_test_name}: "
                        f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
                tally.failures.append(line)
                if isinstance(exc, AssertionError):     # assert_close: the values differ
                    tally.wrong.append(f"{line} (sample {k})")
        tally.clean += clean
    return tally


if __name__ == "__main__":  # python opinfo_samples.py [SHARD SHARDS [DEVICE [SAMPLES]]]
    import sys
    shard, shards = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (0, 1)
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    samples = int(sys.argv[4]) if len(sys.argv) > 4 else SAMPLES_PER_OP
    result = run_ops(float32_ops("cpu", device)[shard::shards], device, samples)
    print("\n".join(result.failures))
    print(result.summary())
