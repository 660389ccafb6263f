"""What each plugin hook must return, and the check of every contribution against it.

The plugin layer sits below the layers that define the contributed types (operator
definitions, templates, mapping rules, passes), so those types are declared from above with
`expect_contributions`; `checked` then verifies each hook's result inside the plugin's error
boundary, so a plugin returning the wrong thing is reported by name and contributes nothing.
"""
from __future__ import annotations

# contribution kind -> hook name
HOOKS = {
    "operators": "kiln_operators",
    "schedules": "kiln_schedules",
    "torch_mappings": "kiln_torch_mappings",
    "graph_passes": "kiln_graph_passes",
    "rewrite_patterns": "kiln_rewrite_patterns",
}

_expected: dict[str, type] = {}


class ContributionError(TypeError):
    """A plugin hook returned something other than a list of the objects it must contribute."""


def expect_contributions(types: dict[str, type]) -> None:
    """Declare the type every contribution of each kind must have (kind -> type)."""
    unknown = set(types) - set(HOOKS)
    if unknown:
        raise ValueError(f"unknown contribution kinds: {', '.join(sorted(unknown))}")
    _expected.update(types)


def _named(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def checked(kind: str, result) -> list:
    """`result` of the hook for `kind` as a list, every item of the expected type (None, from
    a hook with nothing to give, is the empty list)."""
    hook = HOOKS[kind]
    expected = _expected.get(kind)
    if expected is None:
        raise RuntimeError(f"Kiln declares no contribution type for {hook} (import kiln first)")
    if result is None:
        return []
    if not isinstance(result, (list, tuple)):
        raise ContributionError(f"{hook} returned {type(result).__name__} {_shown(result)}; "
                                f"expected a list of {_named(expected)}")
    for item in result:
        if not isinstance(item, expected):
            raise ContributionError(f"{hook} returned a list holding {type(item).__name__} "
                                    f"{_shown(item)}; expected only {_named(expected)}")
    return list(result)
