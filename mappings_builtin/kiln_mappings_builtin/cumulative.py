"""Cumulative reductions besides cumsum: cumprod, cummax, cummin and logcumsumexp."""
import torch

from kiln_mappings_builtin.common import direct

for _name in ("cumprod", "cummax", "cummin", "logcumsumexp"):
    direct(_name, [getattr(torch, _name)], [_name])

