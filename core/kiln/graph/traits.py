"""Operator traits: what an operator declares about itself for the graph passes.

A pass never asks an operator's name; it reads the traits its definition carries, declared
next to the definition:

    @operator("matmul", traits=Traits(tf32=True))
    def matmul(x, y, allow_tf32=False):
        ...

so that a plugin's operator takes part in a pass exactly as a built-in one does. An operator
declaring no traits gets `Traits()`, every trait off.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traits:
    """The traits of one operator definition (`OperatorDef.traits`)."""

    tf32: bool = False
    """A matrix product whose float32 operands a GPU may round to TF32 when torch allows it:
    the definition takes an `allow_tf32` attribute, which the `allow_tf32` pass sets and a
    template may read (the definition's values do not change)."""
