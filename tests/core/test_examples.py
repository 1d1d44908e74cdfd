"""The engine loop example (examples/engine_loop.py) runs, returns every slot and row to the
pools, and computes the same logits eagerly and through GraphRunner."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import attnplug
from child import HANG_LIMIT_S
from plugin_dists import ROOT

EXAMPLE = ROOT / "examples" / "engine_loop.py"


def _load_example():
    name = "attnplug_example_engine_loop"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine are far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_loop_graph_path_equals_eager_path(page_size, one_thread):
    loop = _load_example()
    logs = {"eager": [], "graphs": []}
    eager = loop.run_loop(graphs=False, page_size=page_size, log=logs["eager"].append)
    graphs = loop.run_loop(graphs=True, page_size=page_size, log=logs["graphs"].append)
    labels = [label for label, _ in eager]
    assert labels[:2] == ["prefill", "prefill C, chunk 2"] and "verify" in labels and len(labels) == 17
    assert loop.compare(eager, graphs, rtol=1e-5, atol=1e-5) < 1e-5
    assert all(torch.isfinite(logits).all() for _, logits in eager)
    text = "\n".join(logs["graphs"])
    # bs=3 steps replay the bucket of 4 (one padded request), bs=2 steps the bucket of 2
    assert "DECODE        bs=3 T=3   graph bs=4" in text and "DECODE        bs=2 T=2   graph bs=2" in text
    assert "TARGET_VERIFY bs=3 T=9   graph bs=4" in text
    # prefill chunks replay token-count buckets (the reference backend captures EXTEND steps)
    assert "EXTEND        bs=3 T=29  graph tokens=32" in text and "EXTEND        bs=1 T=9   graph tokens=16" in text
    assert "A: 3/3, B: 1/3, C: 0/3" in text and logs["eager"][-1].startswith("done: pools full")


def test_a_real_difference_between_the_paths_is_reported(one_thread):
    loop = _load_example()
    eager = loop.run_loop(graphs=False, log=lambda line: None)
    changed = [(label, x.clone()) for label, x in eager]
    changed[5][1][0, 0] += 1e-3
    with pytest.raises(AssertionError, match="decode 4: graph path differs"):
        loop.compare(eager, changed, rtol=1e-5, atol=1e-5)


def test_engine_loop_uses_the_public_api_only():
    tree = ast.parse(EXAMPLE.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnplug"):
            assert node.module == "attnplug", f"line {node.lineno}: import from {node.module}"
            assert {a.name for a in node.names} <= set(attnplug.__all__)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("attnplug") for a in node.names), f"line {node.lineno}"


def test_engine_loop_script_runs():
    env = dict(os.environ, OMP_NUM_THREADS="1", ATTNPLUG_PLUGINS="reference")
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=HANG_LIMIT_S
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "--- eager ---" and "--- graphs ---" in lines
    assert lines[-1].startswith("graph path equals eager path: 17 steps")
