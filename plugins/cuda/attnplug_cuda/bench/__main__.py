"""``python -m attnplug_cuda.bench ARGS`` is ``attnplug bench --backend cuda --device cuda ARGS``
(it also works from a plain checkout, where the ``cuda`` entry point may not be installed)."""

from __future__ import annotations

import sys
from typing import List, Optional

SPEC = ["--backend", "attnplug_cuda.backend:CudaBackend", "--device", "cuda"]


def main(argv: Optional[List[str]] = None) -> int:
    from attnplug.cli import main as cli_main

    return cli_main(["bench", *SPEC, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
