"""Kiln: a deep-learning compiler for PyTorch that generates its own kernels.

`import kiln` loads no plugin; the first use of `kiln.ops`, of the torch mapping registry or of
the torch.compile backend discovers them. `kiln.save(compiled_model, path)` and
`kiln.load(path)` keep a compiled model for another process (`kiln.load(path, model=model)` for
one with graph breaks); `kiln.log` is the logger `kiln`;
`kiln.settings` holds every setting (environment variables as defaults, `kiln.settings.patch`).
"""

from kiln import dtypes, ops, settings
from kiln.device import Device, device
from kiln.dtypes import DataType, data_type
from kiln.frontend.torch.errors import UnmappedOperatorError
from kiln.graph import FlowGraph, operator, trace_from
from kiln.passes import PassContext
from kiln.tensor import (
    Tensor, asarray, empty, from_torch, full, ones, randn, symbol, symbol_like, zeros,
)

from kiln import torch  # noqa: E402  (kiln.torch: the PyTorch frontend; loads no plugin)
from kiln.frontend.torch.registry import Rule as _Rule
from kiln.graph import OperatorDef as _OperatorDef
from kiln.passes import GraphPass as _GraphPass, RewritePattern as _RewritePattern
from kiln.plugins import expect_contributions as _expect_contributions
from kiln.schedule import Template as _Template

# What each plugin hook must return: every contribution is checked against it when plugins load.
_expect_contributions({"operators": _OperatorDef, "schedules": _Template, "torch_mappings": _Rule,
                       "graph_passes": _GraphPass, "rewrite_patterns": _RewritePattern})
from kiln.frontend.torch.persist import load, save  # noqa: E402

from kiln.version import VERSION as __version__  # noqa: E402

__all__ = [
    "DataType", "Device", "FlowGraph", "PassContext", "Tensor", "asarray", "data_type", "device", "dtypes", "settings",
    "empty", "from_torch", "full", "ones", "operator", "ops", "randn", "symbol", "symbol_like",
    "trace_from", "zeros", "torch", "UnmappedOperatorError", "save", "load",
]
