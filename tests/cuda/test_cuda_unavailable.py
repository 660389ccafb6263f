"""Without cuda-python or a GPU, Kiln still imports and says why CUDA is unavailable."""
import sys

import pytest
import torch

from kiln.runtime import cuda as rt


def test_missing_cuda_python_is_explained(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(rt.CudaError, match=r"cuda-python.*kiln-core\[cuda\]"):
        rt._bindings()


def test_reason_names_the_missing_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    reason = rt.unavailable_reason()
    assert reason is not None and ("GPU" in reason or "cuda-python" in reason)


def test_cuda_device_info_fails_clearly_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(rt.CudaError, match="CUDA is unavailable"):
        rt._make_current(0)
