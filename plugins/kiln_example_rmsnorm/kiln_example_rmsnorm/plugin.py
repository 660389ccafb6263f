"""The plugin object of the entry point: hook implementations returning what it contributes."""
from kiln.frontend.torch import rules_of
from kiln.plugins import hookimpl

from kiln_example_rmsnorm import mapping, operator


@hookimpl
def kiln_operators():
    return [operator.fused_rms_norm]


@hookimpl
def kiln_torch_mappings():
    return rules_of(mapping)
