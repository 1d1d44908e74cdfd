"""The comparisons of a whole-step benchmark beside the baseline's: two variants of one backend
(``StepRatio``: a speedup row, and whether every layer's output is bit-identical), another
implementation timed on the same world (``StepPeer``: its time and the ratio to a variant) and
a variant's attention against float32 attention over its cache (``attention_check_rows``).
Each returns its rows; ``step_case.run_step_benchmark`` appends them.
"""

from __future__ import annotations

import traceback
from typing import List

import torch

from .rows import error_row, row
from .step_check import check_row, decode_check
from .step_measure import layer_outputs
from .step_spec import PeerUnavailable, StepPeer, StepRatio
from .timing import free_memory

__all__ = ["attention_check_rows", "peer_rows", "ratio_rows"]


def ratio_rows(ctx, name, label, r: StepRatio, times, outs, worlds, backends, variants, mode, bs) -> List[dict]:
    """The rows of ``r`` at one case; ``worlds[v]``: the world variant ``v`` ran on."""
    ts, tf = times[r.slow], times[r.fast]
    s = ts / tf
    out: List[dict] = []
    same = None
    diff = (outs[r.slow] - outs[r.fast]).abs().max().item()
    if r.identical:
        try:
            a = layer_outputs(backends[r.slow], worlds[r.slow], mode, bs, with_cpu=variants[r.slow].with_cpu)
            b = layer_outputs(backends[r.fast], worlds[r.fast], mode, bs, with_cpu=variants[r.fast].with_cpu)
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
    target = r.target_at(bs)
    out.append(
        row(
            name,
            label,
            f"speedup ({r.slow} / {r.fast})",
            s,
            "x",
            target=None if target is None else f">= {target:g}x",
            met=None if target is None else s >= target,
            key=True,
            bs=bs,
            max_abs_out_diff=diff,
            **{f"{r.slow}_us": ts, f"{r.fast}_us": tf},
            detail=f"step: {r.fast} {tf:.1f} us, {r.slow} {ts:.1f} us"
            + (f"; max |out diff| {diff:.2e}" if same is None else "")
            + ("" if same is None else ("; outputs bit-identical" if same else "; OUTPUTS DIFFER")),
        )
    )
    ctx.log(
        f"  {label:20s} {r.fast} {tf:9.1f} us  {r.slow} {ts:9.1f} us  ratio {s:5.2f}x  identical: {same}"
        f"  (max |out diff| {diff:.2e})"
    )
    return out


def attention_check_rows(ctx, name, label, v: str, backend, world, bs: int, *, with_cpu: bool = False) -> List[dict]:
    """Variant ``v``'s DECODE attention at ``bs`` against float32 attention over its cache
    (``step_check.decode_check``): one row, or an error row when the check could not run."""
    try:
        diffs = decode_check(backend, world, bs, with_cpu=with_cpu)
    except Exception as exc:
        ctx.log(f"  {label} {v} check: FAILED {type(exc).__name__}: {exc}")
        return [error_row(name, f"{label} {v} vs float32 torch (same keys)", "max |out diff|", "", exc)]
    finally:
        free_memory(ctx.timer)
    checked = check_row(name, label, v, diffs, world, key=bs == 1)
    ctx.log(f"  {label} {v}: max |out diff| {checked['value']:.2e} against float32 attention ({checked['detail']})")
    return [checked]


def peer_rows(ctx, name, label, peer: StepPeer, times, world, mode, bs, series, unavailable) -> List[dict]:
    try:
        us, detail, *more = peer.measure(ctx, world, mode, bs)
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
            key=True,
            detail=detail,
            **(more[0] if more else {}),
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
