"""Argument checks shared by the public API: integer arguments and their bounds.

Integer arguments accept ``int`` and integer-likes (numpy and 0-d torch integer scalars:
anything :func:`operator.index` takes), never ``bool`` or a float, and say in the error
what was expected (STYLE: validate at the boundary, with the expectation in the message).
"""

from __future__ import annotations

import operator

__all__ = ["as_int"]


def as_int(name: str, value: object, *, minimum: int | None = None, below: int | None = None) -> int:
    """``value`` as an ``int`` in ``[minimum, below)`` (either bound optional); ValueError
    naming ``name`` and the expected range otherwise."""
    if minimum is not None and below is not None:
        expected = f"an int in [{minimum}, {below})"
    elif minimum is not None:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    elif below is not None:
        expected = f"an int < {below}"
    else:
        expected = "an int"
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}") from None
    if (minimum is not None and n < minimum) or (below is not None and n >= below):
        raise ValueError(f"{name}: expected {expected}, got {n}")
    return n
