"""A stand-in for torchvision, for .ci/run's SGLang smoke run only (never installed).

SGLang imports torchvision at module level (its multimodal utilities), and the PyPI torchvision
that matches the CPU build of torch here is a CUDA build that breaks ``transformers``. This
package makes those imports succeed and nothing more: every attribute is a name, and calling any
of them raises, so a run that really used torchvision fails loudly instead of passing. The
``torchvision-0.0.0.dist-info`` beside it gives ``transformers`` a version to compare (0.0.0:
older than anything it would use).
"""

import sys
import types


class _Name:
    """An attribute of the stand-in: further attributes are names, a call raises."""

    def __init__(self, path):
        self._path = path

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"stand-in torchvision (attnplug's SGLang smoke run): {self._path} was called")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Name(f"{self.__name__}.{name}")


__version__ = "0.0.0"
for _sub in (
    "transforms",
    "transforms.functional",
    "transforms.v2",
    "transforms.v2.functional",
    "io",
    "ops",
    "models",
    "utils",
):
    sys.modules[f"{__name__}.{_sub}"] = _Module(f"{__name__}.{_sub}")
