"""Reductions and normalizations of empty tensors, which the operators refuse: the result's
shape comes from PyTorch's meta tensors and its values are what PyTorch gives (0 for sums, 1 for
products, NaN for means and variances, nothing for an empty result)."""
import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import is_tensor

# torch function -> the value of each element of a non-empty result
EMPTY_RESULTS = {torch.sum: 0, torch.nansum: 0, torch.prod: 1, torch.mean: float("nan"),
                 torch.nanmean: float("nan"), torch.var: float("nan"), torch.std: float("nan"),
                 torch.var_mean: float("nan"), torch.std_mean: float("nan"), torch.softmax: None,
                 torch.log_softmax: None, F.softmax: None, F.log_softmax: None, F.softmin: None,
                 torch.count_nonzero: 0, torch.logsumexp: float("-inf")}


def _has_empty_input(*args, **kwargs) -> bool:
    return any(is_tensor(a) and a.numel() == 0 for a in list(args) + list(kwargs.values()))


def _on_meta(value):
    return torch.empty(value.shape, dtype=value.dtype.torch_dtype, device="meta") if is_tensor(value) else value


def _empty_rule(function, fill):
    def rule(*args, **kwargs):
        device = next(a.device for a in list(args) + list(kwargs.values()) if is_tensor(a))
        result = function(*[_on_meta(a) for a in args], **{k: _on_meta(v) for k, v in kwargs.items()})

        def make(meta):
            value = 0 if fill is None else fill
            return ops.full(tuple(meta.shape), value, dtype=meta.dtype, device=device)

        return tuple(make(r) for r in result) if isinstance(result, tuple) else make(result)
    rule.__name__ = rule.__qualname__ = f"empty_{function.__name__}"
    return rule


for _function, _fill in EMPTY_RESULTS.items():
    _rule = _empty_rule(_function, _fill)
    register_function(_function, priority=5, check=_has_empty_input)(_rule)
    if _function.__module__ == "torch" and hasattr(torch.Tensor, _function.__name__):
        register_method(_function.__name__, priority=5, check=_has_empty_input)(
            _empty_rule(getattr(torch.Tensor, _function.__name__), _fill))
