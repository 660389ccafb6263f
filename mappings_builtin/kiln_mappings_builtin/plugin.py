"""The entry point of kiln-mappings-builtin: the rules of every module in RULE_MODULES."""
from kiln.frontend.torch import rules_of
from kiln.plugins import hookimpl

from kiln_mappings_builtin import (
    common, convert, creation, elementwise, indexing, modules, nn, reduce, shape,
)

RULE_MODULES = (common, convert, creation, elementwise, indexing, modules, nn, reduce, shape)


@hookimpl
def kiln_torch_mappings():
    return rules_of(*RULE_MODULES)
