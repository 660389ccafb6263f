"""Graph passes for particular built-in operators, contributed by the plugin's
`kiln_graph_passes` hook (`PASSES`), each running in the pipeline stage it declares."""
from kiln_ops_builtin.passes.sibling_linears import MergeSiblingLinears
from kiln_ops_builtin.passes.zero_filters import ZeroFilters

PASSES = (MergeSiblingLinears(), ZeroFilters())
