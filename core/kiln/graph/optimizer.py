"""`kiln.graph.optimize`: a FlowGraph through the optimization pipeline.

The pipeline belongs to the pass manager, a layer above graphs (`kiln.passes` imports
`kiln.graph`, never the reverse): `kiln.passes` installs its `optimize` here when it is
imported, which `import kiln` always does.
"""
from __future__ import annotations

from typing import Callable

_pipeline: Callable | None = None


def use_pipeline(run: Callable) -> None:
    """Make `run(graph) -> graph` the pipeline that `optimize` applies."""
    global _pipeline
    _pipeline = run


def optimize(graph):
    """`graph` (a FlowGraph) optimized by the default pass pipeline under the current
    `kiln.PassContext` (see `kiln.passes`); inputs, outputs and their order are kept."""
    if _pipeline is None:
        raise RuntimeError("no optimization pipeline is installed: import kiln (or kiln.passes) first")
    return _pipeline(graph)
