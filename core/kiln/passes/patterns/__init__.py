"""The rewrite patterns shipped with the core. Each matches operators by name and uses only
operators some plugin provides, declining a match otherwise."""
from kiln.passes.patterns.attention import ATTENTION_PATTERNS
from kiln.passes.patterns.fold_batch_norm import BATCH_NORM_PATTERNS
from kiln.passes.patterns.matmul_bias import matmul_bias
from kiln.passes.patterns.shape_chains import SHAPE_PATTERNS
from kiln.passes.patterns.softmax_dtype import SOFTMAX_DTYPE_PATTERNS

SHIPPED = (*BATCH_NORM_PATTERNS, matmul_bias, *SHAPE_PATTERNS, *SOFTMAX_DTYPE_PATTERNS, *ATTENTION_PATTERNS)

__all__ = ["SHIPPED"]
