"""Looking up an operator that a plugin may or may not provide."""
from kiln.plugins import OperatorNotFoundError, PluginError, registry


def provided(name: str):
    """The definition of operator `name`, or None where no plugin provides it."""
    try:
        return registry().operator(name)
    except (OperatorNotFoundError, PluginError):
        return None
