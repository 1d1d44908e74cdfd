"""Errors of the transformers integration."""

from __future__ import annotations

__all__ = ["UnsupportedModelError", "MissingDependencyError", "require_transformers"]


class UnsupportedModelError(ValueError):
    """The model (or the chosen backend) cannot be run through attnplug exactly; the message
    says why. attnplug never approximates a model it cannot express."""


class MissingDependencyError(ImportError):
    """``transformers`` is not installed (``pip install attnplug[hf]``)."""


def require_transformers():
    """Import and return the ``transformers`` module, or raise ``MissingDependencyError``
    naming the ``hf`` extra."""
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            "the transformers integration needs the transformers package: pip install 'attnplug[hf]'"
        ) from exc
    return transformers
