"""The entry point of kiln-mappings-aten: the rules (and decompositions) of every module in
RULE_MODULES."""
from kiln.frontend.torch import rules_of
from kiln.plugins import hookimpl

from kiln_mappings_aten import (attention, common, creation, decompositions, elementwise, embedding, fft, indexing,
                                linalg, nn, pool_offsets, reduce, rnn, shape)

RULE_MODULES = (attention, common, creation, decompositions, elementwise, embedding, indexing, linalg, nn,
                pool_offsets, reduce, rnn, shape, fft)


@hookimpl
def kiln_torch_mappings():
    return rules_of(*RULE_MODULES)
