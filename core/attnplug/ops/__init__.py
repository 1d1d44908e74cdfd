"""The engine-neutral op layer: store and attend over caches, slot mappings and block tables
that the caller owns (an engine such as vLLM or SGLang allocates the KV memory itself).

``PagedOps`` (``base.py``) is the contract every backend's ops keep; ``PortableOps``
(``portable.py``) is the pure-PyTorch one, whose math ``PortableBackend`` shares. A backend
class names its ops with ``AttentionBackend.paged_ops(device)``. docs/engines.md says how an
engine uses them.
"""

from .base import OpsInputError, PagedOps, PagedStep
from .portable import PortableOps, attend_gathered

__all__ = ["OpsInputError", "PagedOps", "PagedStep", "PortableOps", "attend_gathered"]
