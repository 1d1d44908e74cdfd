"""Every Triton kernel of the CUDA plugin has a name of its own (profiler traces and
compute-sanitizer reports name kernels by function name), and docs/architecture.md uses it."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = ROOT / "plugins" / "cuda" / "attnplug_cuda" / "kernels"


def _jit_functions(path: pathlib.Path):
    for node in ast.parse(path.read_text()).body:
        decorators = [d.func if isinstance(d, ast.Call) else d for d in getattr(node, "decorator_list", ())]
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d).endswith("jit") for d in decorators):
            yield node.name


def test_triton_kernels_have_distinct_descriptive_names():
    kernels = {}
    for path in sorted(KERNELS.glob("*.py")):
        for name in _jit_functions(path):
            if name.endswith("_kernel"):
                kernels.setdefault(name, []).append(path.name)
    assert set(kernels) == {
        "_kv_store_kernel",
        "_step_metadata_kernel",
        "_paged_attention_kernel",
        "_split_combine_kernel",
        "_store_attend_kernel",
    }, kernels
    assert all(len(files) == 1 for files in kernels.values()), kernels
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert [name for name in kernels if name not in architecture] == []
