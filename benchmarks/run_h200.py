#!/usr/bin/env python3
"""Run the CUDA plugin's benchmark suite from a plain checkout (see benchmarks/README.md).

    python benchmarks/run_h200.py [--quick] [--only NAME ...] [--out DIR] [--budget-s S] [--set NAME=VALUE]

Exactly ``attnplug bench --backend cuda --device cuda ARGS`` (the same harness,
``attnplug.bench``); this script only puts the repository's source folders first on
``sys.path`` so no install is needed. Exit status: 0 when the run completed, 1 when a
benchmark failed with an error, 2 without a CUDA device.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("conformance", "plugins/cuda", "core"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)

from attnplug_cuda.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
