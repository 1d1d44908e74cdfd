"""The example backend: the reference backend under another name.

A real plugin implements every ``AttentionBackend`` method with its own kernels; subclassing the
reference backend is a convenient way to start (everything works, then replace one method at a
time and let the conformance suite compare the results).
"""

from attnplug.backends.reference import ReferenceBackend


class ExampleBackend(ReferenceBackend):
    name = "example"

    @classmethod
    def describe(cls) -> dict:
        """Class-level hints shown by ``attnplug info`` (no device is touched)."""
        return {"pdl": False, "graphs": "ALWAYS", "needs_cpu_seq_lens": cls.needs_cpu_seq_lens}
