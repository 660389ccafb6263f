"""The entry point of kiln-ops-builtin: the operators of every module in OPERATOR_MODULES."""
from kiln.graph import OperatorDef
from kiln.plugins import hookimpl

from kiln_ops_builtin import activations, attention, conv, elementwise, linalg, pool, resize, normalization, reduce, shape, indexing, creation

OPERATOR_MODULES = (elementwise, activations, linalg, attention, conv, pool, resize, reduce, normalization, shape, indexing, creation)


@hookimpl
def kiln_operators():
    return [v for m in OPERATOR_MODULES for v in vars(m).values() if isinstance(v, OperatorDef)]


@hookimpl
def kiln_schedules():
    from kiln_ops_builtin.templates import TEMPLATES
    return list(TEMPLATES)
