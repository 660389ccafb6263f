"""The entry point of kiln-ops-builtin: the operators of every module in OPERATOR_MODULES."""
from kiln.graph import OperatorDef
from kiln.plugins import hookimpl

from kiln_ops_builtin import elementwise, linalg

OPERATOR_MODULES = (elementwise, linalg)


@hookimpl
def kiln_operators():
    return [v for m in OPERATOR_MODULES for v in vars(m).values() if isinstance(v, OperatorDef)]
