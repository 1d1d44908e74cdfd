"""Core and conformance are device-neutral: no vendor name in code (comments and docstrings
may mention one), except the contract's own ``*cuda_graph*`` names kept for compatibility
with the engines backends are ported from."""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEUTRAL_TREES = [ROOT / "core" / "attnplug", ROOT / "conformance" / "attnplug_conformance"]
VENDOR = re.compile(r"(?<![A-Za-z])(cuda|npu|xpu|torch_npu|ipex|nvidia|ascend|intel)(?![A-Za-z])", re.IGNORECASE)
CONTRACT_NAMES = re.compile(r"\w*cuda_graph\w*")
_STATEMENT_START = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def vendor_mentions(source: str) -> list:
    """(line, text) of every vendor name in code tokens, docstrings and comments excluded."""
    found, previous = [], tokenize.ENCODING
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL):
            continue
        is_docstring = tok.type == tokenize.STRING and previous in _STATEMENT_START
        if tok.type in (tokenize.NAME, tokenize.STRING) and not is_docstring:
            text = CONTRACT_NAMES.sub("", tok.string)
            if VENDOR.search(text):
                found.append((tok.start[0], tok.string))
        previous = tok.type
    return found


def _sources():
    for tree in NEUTRAL_TREES:
        yield from sorted(tree.rglob("*.py"))


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_vendor_name_in_code(path):
    hits = vendor_mentions(path.read_text())
    assert not hits, f"{path.relative_to(ROOT)} names a device vendor in code: {hits}"


def test_detector_sees_code_and_skips_comments_and_docstrings():
    src = '"""Runs on cuda."""\nx = 1  # cuda here is fine\nif dev.type == "cuda":\n    torch.npu.foo()\n'
    assert vendor_mentions(src) == [(3, '"cuda"'), (4, "npu")]
    assert vendor_mentions("def init_cuda_graph_state(self): pass\n") == []
