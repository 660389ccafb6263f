"""Looking up an operator that a plugin may or may not provide."""
from kiln.plugins import OperatorNotFoundError, PluginError, registry


def provided(name: str):
    """The definition of operator `name`, or None where no plugin provides it."""
    try:
        return registry().operator(name)
    except (OperatorNotFoundError, PluginError):
        return None


def implementer(job):
    """The definition of the operator implementing `job` (`kiln.graph.Traits.implements`), or
    None where no plugin provides one."""
    try:
        return registry().implementing(job)
    except (OperatorNotFoundError, PluginError):
        return None
