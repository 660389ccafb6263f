"""`kiln.ops.NAME`: every operator the installed plugins define, resolved on first use.

Importing this module also makes Tensor's Python operators (`a + b`) apply the operators that
implement them (`kiln.graph.Traits.implements`).
"""
from kiln.plugins import registry as _registry
from kiln.tensor import use_operators as _use_operators


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _registry().operator(name)


def __dir__():
    return sorted(_registry().operators)


_use_operators(lambda job: _registry().implementing(job))
