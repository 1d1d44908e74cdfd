"""The comparisons of a whole-step benchmark beside the baseline's: two variants of one backend
(``StepRatio``: a speedup row, and whether every layer's output is bit-identical) and another
implementation timed on the same world (``StepPeer``: its time and the ratio to a variant).
Each returns its rows; ``step_case.run_step_benchmark`` appends them.
"""

from __future__ import annotations

import traceback
from typing import List

import torch

from .rows import row
from .step_measure import layer_outputs
from .step_spec import PeerUnavailable, StepPeer, StepRatio
from .timing import free_memory

__all__ = ["peer_rows", "ratio_rows"]


def ratio_rows(ctx, name, label, r: StepRatio, times, outs, world, backends, variants, mode, bs) -> List[dict]:
    ts, tf = times[r.slow], times[r.fast]
    s = ts / tf
    out: List[dict] = []
    same = None
    if r.identical:
        try:
            a = layer_outputs(backends[r.slow], world, mode, bs, with_cpu=variants[r.slow].with_cpu)
            b = layer_outputs(backends[r.fast], world, mode, bs, with_cpu=variants[r.fast].with_cpu)
            differ = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
            same = not differ and bool(torch.equal(outs[r.slow], outs[r.fast]))
            out.append(
                row(
                    name,
                    label,
                    f"{r.slow} vs {r.fast}: outputs",
                    0 if same else len(differ) or 1,
                    "layers differ",
                    target="bit-identical",
                    met=same,
                    key=True,
                    layers_differing=differ,
                    detail="every layer of an eager step and the replayed step's output, compared bit for bit",
                )
            )
        except Exception as exc:
            out.append(
                row(name, label, f"{r.slow} vs {r.fast}: outputs", None, "", error=f"{type(exc).__name__}: {exc}")
            )
        finally:
            free_memory(ctx.timer)
    held = r.target is not None
    out.append(
        row(
            name,
            label,
            f"speedup ({r.slow} / {r.fast})",
            s,
            "x",
            target=f">= {r.target:g}x" if held else None,
            met=(s >= r.target) if held else None,
            key=True,
            bs=bs,
            **{f"{r.slow}_us": ts, f"{r.fast}_us": tf},
            detail=f"step: {r.fast} {tf:.1f} us, {r.slow} {ts:.1f} us"
            + ("" if same is None else ("; outputs bit-identical" if same else "; OUTPUTS DIFFER")),
        )
    )
    ctx.log(f"  {label:20s} {r.fast} {tf:9.1f} us  {r.slow} {ts:9.1f} us  ratio {s:5.2f}x  identical: {same}")
    return out


def peer_rows(ctx, name, label, peer: StepPeer, times, world, mode, bs, series, unavailable) -> List[dict]:
    try:
        us, detail = peer.measure(ctx, world, mode, bs)
    except PeerUnavailable as exc:
        unavailable[peer.name] = str(exc)
        ctx.log(f"  peer {peer.name}: {exc}")
        return [row(name, f"peer: {peer.name}", "time per step", None, "us", notes=str(exc), key=True)]
    except Exception as exc:
        ctx.log(f"  {label} {peer.name}: FAILED {type(exc).__name__}: {exc}")
        return [
            row(
                name,
                f"{label} {peer.name}",
                "time per step",
                None,
                "us",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
        ]
    finally:
        free_memory(ctx.timer)
    out = [
        row(
            name,
            f"{label} {peer.name}",
            "time per step",
            us,
            "us",
            variant=peer.name,
            bs=bs,
            series=series,
            detail=detail,
        )
    ]
    ctx.log(f"  {label} {peer.name}: {us:.1f} us/step ({peer.what})")
    if peer.against in times:
        t = times[peer.against]
        s = us / t
        target = peer.target(mode, bs)
        out.append(
            row(
                name,
                label,
                f"speedup ({peer.name} / {peer.against})",
                s,
                "x",
                target=None if target is None else f">= {target:g}x",
                met=None if target is None else s >= target,
                key=True,
                bs=bs,
                series=series,
                **{f"{peer.name}_us": us, f"{peer.against}_us": t},
                detail=f"{peer.against} {t:.1f} us (whole step), {peer.name} {us:.1f} us"
                + (f" ({peer.what})" if peer.what else ""),
            )
        )
    return out
