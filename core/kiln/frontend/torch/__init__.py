"""Kiln's PyTorch frontend (also `kiln.torch`): the torch.compile backend "kiln" and its parts.

- `register_function`, `register_method`, `register_module`, `KilnModule`: mapping rules;
  `register_decomposition`: Kiln's own decompositions of ATen overloads in training graphs;
  `register_graph_rewrite`: rewrites of dynamo graphs before AOTAutograd traces them;
- `dynamo_config`: the backend's settings;
- `unmapped_operators(model, *inputs)`: what no rule maps yet;
- `traced_argument(k)`: inside a rule, the tensor PyTorch traced its argument k as (strides);
- `kiln_backend`: the backend itself (`torch.compile(model, backend="kiln")` finds it by
  entry point, without `import kiln`).
"""
from kiln.frontend.torch.backend import KilnFunction, kiln_backend
from kiln.frontend.torch.config import DynamoConfig, dynamo_config
from kiln.frontend.torch.errors import UnmappedOperator, UnmappedOperatorError
from kiln.frontend.torch.interpreter import Interpreter, MappingError, traced_argument
from kiln.frontend.torch.registry import (
    KilnModule, MappingRegistry, Rule, mapping_registry, register_function, register_method,
    register_decomposition, register_graph_rewrite, register_module, rules_of,
)
from kiln.frontend.torch.unmapped import unmapped_operators

__all__ = [
    "DynamoConfig", "Interpreter", "KilnFunction", "KilnModule", "MappingError", "MappingRegistry",
    "Rule", "UnmappedOperator", "UnmappedOperatorError", "dynamo_config", "kiln_backend",
    "mapping_registry", "register_decomposition", "register_function", "register_graph_rewrite", "register_method",
    "register_module", "rules_of",
    "traced_argument", "unmapped_operators",
]
