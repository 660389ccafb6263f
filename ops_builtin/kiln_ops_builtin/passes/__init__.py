"""Graph passes for particular built-in operators, contributed by the plugin's
`kiln_graph_passes` hook (`PASSES`), each running in the pipeline stage it declares."""
from kiln_ops_builtin.passes.aligned_rows import AlignedRows
from kiln_ops_builtin.passes.causal_masks import CausalMasks
from kiln_ops_builtin.passes.channel_gates import FoldChannelGates
from kiln_ops_builtin.passes.sibling_linears import MergeSiblingLinears
from kiln_ops_builtin.passes.space_to_depth import SpaceToDepth
from kiln_ops_builtin.passes.zero_filters import ZeroFilters

# in the order they run within a stage: space-to-depth pads the stacked cells that zero filters
# may then drop, before channel gates fold into 1x1 convolutions
PASSES = (MergeSiblingLinears(), CausalMasks(), SpaceToDepth(), ZeroFilters(), FoldChannelGates(), AlignedRows())
