"""The entry point of kiln-mappings-builtin: the rules of every module in RULE_MODULES."""
from kiln.frontend.torch import rules_of
from kiln.plugins import hookimpl

from kiln_mappings_builtin import (
    activations, arrange, attention, bicubic, common, complex_values, convert, creation, cumulative, eager_attention,
    elementwise, empty, fft, indexing, losses, masked, modules, nn, normalization, products, reduce, rnn, scatter, shape,
    sorting, special, statistics, views,
)

RULE_MODULES = (common, convert, creation, elementwise, indexing, modules, nn, reduce, shape,
                special, losses, products, arrange, activations, normalization, sorting,
                cumulative, scatter, attention, views, statistics, masked, empty, bicubic, rnn, complex_values, fft,
                eager_attention)


@hookimpl
def kiln_torch_mappings():
    return rules_of(*RULE_MODULES)
