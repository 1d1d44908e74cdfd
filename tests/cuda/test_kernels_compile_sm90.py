"""Every Triton launch of the cuda backend compiles for sm_90 on this machine (no GPU needed),
with no register spills in the decode and draft tiles (but a few bytes in the decode tiles over
an FP8 cache: ``sm90_compile.FP8_DECODE_SPILL_BYTES``).

The interpreted kernel tests run the kernels' semantics, not Triton's compiler; this runs
``tests/cuda/sm90_compile.py`` (the launches of a small serving loop, compiled to cubins for
an H200-class target) in a process without ``TRITON_INTERPRET``.
"""

import os
import subprocess
import sys

import pytest

from child import HANG_LIMIT_S

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")


pytestmark = pytest.mark.slow  # compiles every launch for sm_90 offline


def test_every_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "sm90_compile.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=HANG_LIMIT_S)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    summary = proc.stdout.strip().splitlines()[-1]
    for kernel in (
        "_kv_store_kernel",
        "_paged_attention_kernel",
        "_split_combine_kernel",
        "_step_metadata_kernel",
        "_store_attend_kernel",
    ):
        assert kernel in summary, summary
