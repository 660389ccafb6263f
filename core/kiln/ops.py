"""`kiln.ops.NAME`: every operator the installed plugins define, resolved on first use."""
from kiln.plugins import registry


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return registry().operator(name)


def __dir__():
    return sorted(registry().operators)
