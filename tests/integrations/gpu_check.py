"""Every architecture through Engine on a GPU: tokens against transformers, eager and graphs.

    python tests/integrations/gpu_check.py [--backend cuda] [--new 24] [--device cuda]

Per architecture (tiny random model, head_dim 64, window 8, prompts longer than the window):

* ``ref32``: the reference backend on the GPU in float32 must give exactly transformers'
  eager greedy tokens;
* ``eager`` / ``graphs``: the backend in bfloat16 without and with graphs (decode replayed
  through GraphRunner: ``graph_steps`` must equal the decode steps), compared token by token
  with transformers' own bfloat16 eager tokens (``agree`` is the share of equal tokens up to
  the first difference; bfloat16 rounding may make near-ties differ) and with each other.

Logs go to ``$OUT/gpu_check.log`` when ``OUT`` is set. The summary table is printed last; the
exit code is 1 when ``ref32`` differs, a graph step fell back to eager, or a run raised.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))

from hf_helpers import hf_greedy, random_prompts  # noqa: E402

from attnplug.integrations.transformers import ARCHITECTURES, Engine, tiny_model  # noqa: E402


def _prefix_agreement(got, want) -> float:
    """Share of tokens equal before the first difference, over all prompts."""
    same = total = 0
    for g, w in zip(got, want):
        total += len(w)
        for a, b in zip(g, w):
            if a != b:
                break
            same += 1
    return same / max(total, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    log_path = os.path.join(os.environ["OUT"], "gpu_check.log") if os.environ.get("OUT") else None
    log = open(log_path, "w") if log_path else sys.stdout
    prompts = random_prompts([3, 11, 19, 40, 64])
    rows, failed = [], False
    for arch in ARCHITECTURES:
        row = {"arch": arch}
        try:
            m32 = tiny_model(arch, head_dim=64, device=args.device)
            want32 = [hf_greedy(m32, p, args.new) for p in prompts]
            eng = Engine(m32, "reference", max_batch_size=3, max_context_len=128, page_size=4, max_prefill_tokens=16)
            row["ref32"] = "exact" if eng.generate(prompts, args.new) == want32 else "DIFFERS"
            failed |= row["ref32"] != "exact"

            m16 = tiny_model(arch, head_dim=64, dtype=torch.bfloat16, device=args.device)
            want16 = [hf_greedy(m16, p, args.new) for p in prompts]
            outs = {}
            for name, graphs in (("eager", False), ("graphs", True)):
                model = tiny_model(arch, head_dim=64, dtype=torch.bfloat16, device=args.device)
                eng = Engine(
                    model,
                    args.backend,
                    max_batch_size=3,
                    max_context_len=128,
                    page_size=4,
                    max_prefill_tokens=16,
                    cuda_graphs=graphs,
                )
                start = time.perf_counter()
                outs[name] = eng.generate(prompts, args.new)
                row[f"{name}_s"] = f"{time.perf_counter() - start:.2f}"
                row[f"{name}_agree"] = f"{_prefix_agreement(outs[name], want16):.2f}"
                if graphs:
                    run = eng.last_run
                    row["graph_steps"] = f"{run['graph_steps']}/{run['steps']['DECODE']}"
                    failed |= run["graph_steps"] != run["steps"]["DECODE"]
                    print(f"{arch}: graph runner {eng.graphs.status()}", file=log)
            row["eager_vs_graphs"] = f"{_prefix_agreement(outs['graphs'], outs['eager']):.2f}"
        except Exception as exc:  # report every architecture, then fail
            failed = True
            row["error"] = f"{type(exc).__name__}: {exc}"[:120]
            traceback.print_exc(file=log)
        print(row, file=log, flush=True)
        rows.append(row)
    cols = ["arch", "ref32", "eager_agree", "graphs_agree", "eager_vs_graphs", "graph_steps", "eager_s", "graphs_s"]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"backend {args.backend}, {where}, torch {torch.__version__}")
    print(" | ".join(f"{c:>15}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row.get(c, '-'):>15}" for c in cols) + (f"   {row['error']}" if "error" in row else ""))
    print("FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
