"""Reading and writing an NNX variable's array across flax versions (the models' parameters)."""

from __future__ import annotations

import jax
from flax import nnx


def value(p: nnx.Variable) -> jax.Array:
    """A variable's array (flax >= 0.12 deprecates `.value`)."""
    return p.get_value() if hasattr(p, "get_value") else p.value


def set_value(p: nnx.Variable, v) -> None:
    """Give a variable a new array (flax >= 0.12 deprecates assigning `.value`)."""
    if hasattr(p, "set_value"):
        p.set_value(v)
    else:
        p.value = v
