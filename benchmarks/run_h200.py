#!/usr/bin/env python3
"""Run the CUDA plugin's benchmark suite (see benchmarks/README.md) from a plain checkout.

    python benchmarks/run_h200.py [--quick] [--only NAME ...] [--json PATH] [--budget-s S]

The same runner as ``attnplug bench --backend cuda`` and ``python -m attnplug_cuda.bench``;
this script only puts the repository's source folders first on ``sys.path``. Prints progress,
then a compact table LAST, and writes JSON after every benchmark. Exit status: 0 when the run
completed (missed targets and failed cases are in the table and the JSON), 2 without a CUDA
device.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("conformance", "plugins/cuda", "core"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)

from attnplug_cuda.bench.__main__ import build_parser, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
