"""The module named by the ``attnplug.backends`` entry point: the plugin API version it was
written for, a probe, and the hook that registers the backend.

Keep this module cheap and importable everywhere: import device modules inside the probe, and
name the backend class by a string so that it is imported only when it is used.
"""

from attnplug import ProbeResult, hookimpl

PLUGIN_API_VERSION = "1.0"


def probe():
    # A real plugin looks for its device here without initialising it (count devices, check
    # versions) and says what it found or what is missing. This one runs wherever torch does.
    return ProbeResult(True, "the portable PyTorch path; runs wherever PyTorch does", device="any")


@hookimpl
def attnplug_register_backends(register):
    register(
        name="example",
        backend="attnplug_example.backend:ExampleBackend",
        probe=probe,
        priority=-1,  # below the reference backend (0): used only when asked for by name
    )
