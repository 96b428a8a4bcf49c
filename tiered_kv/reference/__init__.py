"""The reference V4-style attention model: the correctness oracle of every tier."""

from .model import ReferenceModel

__all__ = ["ReferenceModel"]
