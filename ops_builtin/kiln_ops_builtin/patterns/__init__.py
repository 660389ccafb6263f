"""Rewrite patterns for particular built-in operators, contributed by the plugin's
`kiln_rewrite_patterns` hook (`PATTERNS`). Each builds only operators some plugin provides,
declining a match otherwise."""
from kiln_ops_builtin.patterns.attention import ATTENTION_PATTERNS
from kiln_ops_builtin.patterns.fold_batch_norm import BATCH_NORM_PATTERNS
from kiln_ops_builtin.patterns.matmul_bias import matmul_bias
from kiln_ops_builtin.patterns.shape_chains import SHAPE_PATTERNS
from kiln_ops_builtin.patterns.softmax_dtype import SOFTMAX_DTYPE_PATTERNS

# tried in this order on each node: shape chains collapse and softmaxes lose their dtype before
# the attention patterns look for them (in the same round, on nodes further on)
PATTERNS = (*BATCH_NORM_PATTERNS, matmul_bias, *SHAPE_PATTERNS, *SOFTMAX_DTYPE_PATTERNS, *ATTENTION_PATTERNS)
