"""Integrations of attnplug with model libraries.

* ``attnplug.integrations.transformers``: Hugging Face ``transformers`` causal LMs run through
  an attnplug backend (``pip install attnplug[hf]``).
"""

from typing import Optional

__all__ = ["transformers_missing"]


def transformers_missing() -> Optional[str]:
    """Why ``attnplug.integrations.transformers`` cannot be used here (transformers not
    installed, or the integration not importable), or None."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"transformers is not installed (pip install 'attnplug[hf]'): {exc}"
    try:
        from . import transformers as _integration  # noqa: F401
    except ImportError as exc:
        return f"attnplug.integrations.transformers cannot be imported: {exc}"
    return None
