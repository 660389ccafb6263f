"""The entry point of kiln-ops-builtin: the operators of every module in OPERATOR_MODULES, the
schedule templates, and the graph passes and rewrite patterns for particular operators."""
from kiln.graph import OperatorDef
from kiln.plugins import hookimpl

from kiln_ops_builtin import (
    activations, attention, attention_training, conv, creation, cumulative, elementwise, grid_sample, indexing, linalg, normalization,
    pool, pool_indices, random, reduce, resize, scatter, shape, sorting, special,
)
from kiln_ops_builtin.passes import PASSES
from kiln_ops_builtin.patterns import PATTERNS

OPERATOR_MODULES = (elementwise, activations, linalg, attention, attention_training, conv, pool, pool_indices, resize, grid_sample, reduce, normalization,
                    shape, indexing, creation, special, sorting, cumulative, scatter, random)


@hookimpl
def kiln_operators():
    return [v for m in OPERATOR_MODULES for v in vars(m).values() if isinstance(v, OperatorDef)]


@hookimpl
def kiln_schedules():
    from kiln_ops_builtin.templates import TEMPLATES
    return list(TEMPLATES)


@hookimpl
def kiln_graph_passes():
    return list(PASSES)


@hookimpl
def kiln_rewrite_patterns():
    return list(PATTERNS)
