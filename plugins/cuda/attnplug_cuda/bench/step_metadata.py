"""Benchmark 2, ``step_metadata``: what it costs the host to prepare one graph replay.

World: 4 layers (3 SWA, 1 full), 32 q / 8 KV heads, D=128, bf16, context 1024 tokens per
request, window 256, requests allocated through ``SWATokenAllocator`` (``attnplug.bench.world``). Cases:
DECODE at bs = 1, 8, 32, 64, 128 and TARGET_VERIFY (4 draft tokens) at bs = 128 (``--quick``:
decode 1 and 128, verify 128). Each path runs through ``attnplug.GraphRunner`` (one bucket:
the case's bs) with the real attention layers as the step.

Per case and path (new = the cuda backend, before = ``BeforeBackend``):

(a) device launches of one ``init_forward_metadata_replay_cuda_graph`` (torch.profiler,
    kernels and memcpys counted apart): target exactly 1 kernel, 0 copies for the new path;
    also the launches of the whole preparation (runner copies + metadata);
(b) host time of one replay preparation = ``runner.prepare`` (``runner.run`` without the
    replay: the runner's static copies + the backend's replay metadata), median over many
    calls (``attnplug.bench.step_case.replay_prep_us``); target <= 30 us at bs = 128;
(c) sync-free: ``runner.run`` (preparation + replay) under
    ``torch.cuda.set_sync_debug_mode("error")``; the new path must not raise (the before
    path is expected to);
(d) enqueue-ahead (largest decode bs): the GPU sleeps ~20 ms (``torch.cuda._sleep``), then 8
    full steps are enqueued; the host time to enqueue them must be far below 20 ms for the
    new path (the host runs ahead), while the before path blocks behind the sleep.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

from attnplug.bench import Ctx, error_row, free_memory, row
from attnplug.bench.step_case import replay_prep_us

NAME = "step_metadata"
CONTEXT, WINDOW, NUM_DRAFT, NUM_LAYERS = 1024, 256, 4, 4
TARGET_PREP_US = 30.0
ENQUEUE_STEPS = 8
SLEEP_MS = 20.0


def _is_device_event(e) -> bool:
    dt = getattr(e, "device_type", None)
    if callable(dt):
        dt = dt()
    return dt is not None and str(dt).upper().endswith("CUDA")


def count_launches(fn) -> Tuple[Optional[int], Optional[int], List[str]]:
    """(kernels, memcpy/memset operations, names) the device ran for ``fn()``, from
    ``torch.profiler``; ``(None, None, [why])`` when the profiler fails or sees no device
    event at all (no CUPTI)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if _is_device_event(e)]
        if not names:  # other layouts: read kineto's raw events
            try:
                names = [e.name() for e in prof.profiler.kineto_results.events() if _is_device_event(e)]
            except Exception:
                names = []
    except Exception as exc:
        torch.cuda.synchronize()
        return None, None, [f"profiler failed: {type(exc).__name__}: {exc}"]
    if not names:
        return None, None, ["profiler saw no device event (CUPTI unavailable?)"]
    copies = [n for n in names if n.startswith(("Memcpy", "Memset"))]
    return len(names) - len(copies), len(copies), names


def sleep_cycles_for(ms: float) -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy about ``ms`` milliseconds."""
    probe = 10_000_000
    rate = None
    for _ in range(2):  # the second reading runs at the clock the first one woke up
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(probe)
        e.record()
        e.synchronize()
        rate = probe / max(s.elapsed_time(e), 1e-3)
    return int(rate * ms)


def enqueue_ahead(run_step, cycles: int, k: int = ENQUEUE_STEPS) -> Tuple[float, float, bool]:
    """(host ms to enqueue ``k`` steps behind a GPU sleep, total ms, GPU still busy after)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    for _ in range(k):
        run_step()
    t1 = time.perf_counter()
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3, busy


def _run_path(
    ctx: Ctx, rows: List[dict], world, backend, path: str, mode, bs: int, iters: int, cycles: int, *, enqueue: bool
) -> Dict[str, object]:
    """Measure (a)-(d) for one path of one case; appends detail rows (JSON) and returns the
    numbers: output, prep_us, md_us, kernels, copies, md_kernels, md_copies, sync_error,
    enqueue (host ms, total ms, GPU busy) or None."""
    from attnplug import ForwardMode, GraphRunner
    from attnplug.bench.world import INPUTS, make_step

    from ..device import strict_sync_guard

    q = 1 if mode is ForwardMode.DECODE else NUM_DRAFT
    T = bs * q
    case = f"{mode.name.lower()} bs={bs} {path}"
    res: Dict[str, object] = {}
    step = make_step(backend, world, T)
    runner = GraphRunner(
        backend,
        step,
        max_bs=bs,
        inputs=INPUTS,
        num_draft_tokens=NUM_DRAFT if q > 1 else None,
        bucket_sizes=[bs],
        modes=[mode],
    )
    runner.capture(strict=True)
    batch = world.batch(mode, bs, with_cpu=(path == "before"))
    inputs = {"x": torch.zeros(T, 1, dtype=INPUTS["x"][1], device=world.pool.device)}
    captured = runner.graphs[(mode, bs)]
    res["output"] = runner.run(batch, inputs).float().clone()

    # (a) launches of the backend's replay metadata (new path; the before path needs the
    # host mirror, so it is counted with the whole preparation below)
    if path == "new":
        k, c, names = count_launches(lambda: backend.init_forward_metadata_replay_cuda_graph(captured.batch))
        res["md_kernels"], res["md_copies"], res["md_names"] = k, c, names
        rows.append(
            row(
                NAME,
                case,
                "replay-metadata device ops",
                None if k is None else k + c,
                "ops",
                kernels=k,
                copies=c,
                device_ops=names,
            )
        )

    def prepare() -> None:
        if not runner.prepare(batch, inputs):
            raise RuntimeError(f"{case}: no captured graph serves the step: {runner.why_eager(batch)}")

    k, c, names = count_launches(prepare)
    res["kernels"], res["copies"] = k, c
    rows.append(
        row(
            NAME,
            case,
            "prep device ops (runner copies + metadata)",
            None if k is None else k + c,
            "ops",
            kernels=k,
            copies=c,
            device_ops=names,
        )
    )
    # (b) host time of one preparation
    res["prep_us"] = us = replay_prep_us(ctx.timer, runner, batch, inputs, iters=iters)
    rows.append(row(NAME, case, "host prep time", us, "us", variant=path, bs=bs, series=mode.name.lower()))
    if path == "new":
        res["md_us"] = ctx.timer.host_us(
            lambda: backend.init_forward_metadata_replay_cuda_graph(captured.batch), iters=iters
        )
        rows.append(row(NAME, case, "host time, backend metadata only", res["md_us"], "us"))
    torch.cuda.synchronize()
    ctx.log(f"  {case:24s} prep {us:8.2f} us  ({k} kernels + {c} copies)")

    # (c) sync-free preparation + replay
    torch.cuda.synchronize()
    err = None
    try:
        with strict_sync_guard():
            for _ in range(3):
                runner.run(batch, inputs)
    except Exception as exc:
        err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    torch.cuda.synchronize()
    res["sync_error"] = err
    rows.append(
        row(
            NAME,
            case,
            "set_sync_debug_mode('error')",
            0 if err is None else 1,
            "raised",
            notes=err or "no sync detected",
        )
    )
    ctx.log(f"  {case:24s} under set_sync_debug_mode('error'): {err or 'no sync'}")

    # (d) enqueue-ahead
    res["enqueue"] = None
    if enqueue:
        host_ms, total_ms, busy = enqueue_ahead(lambda: runner.run(batch, inputs), cycles)
        res["enqueue"] = (host_ms, total_ms, busy)
        rows.append(
            row(
                NAME,
                f"{case}: {ENQUEUE_STEPS} steps behind a {SLEEP_MS:g} ms GPU sleep",
                "host enqueue time",
                host_ms,
                "ms",
                total_ms=total_ms,
                gpu_busy_after_enqueue=busy,
            )
        )
        ctx.log(
            f"  {case}: {ENQUEUE_STEPS} steps behind a {SLEEP_MS:g} ms sleep: host {host_ms:.3f} ms, "
            f"total {total_ms:.3f} ms, GPU busy after enqueue: {busy}"
        )
    torch.cuda.synchronize()
    return res


def run(ctx: Ctx) -> List[dict]:
    from attnplug import ForwardMode
    from attnplug.bench.world import build_world

    from ..backend import CudaBackend
    from .before import BeforeBackend

    rows: List[dict] = ctx.rows
    sizes = (1, 128) if ctx.quick else (1, 8, 32, 64, 128)
    cases = [(ForwardMode.DECODE, bs) for bs in sizes] + [(ForwardMode.TARGET_VERIFY, 128)]
    iters = 300 if ctx.quick else 2000
    world = build_world(
        num_layers=NUM_LAYERS, max_bs=max(sizes), context=CONTEXT, window=WINDOW, num_draft=NUM_DRAFT, device=ctx.device
    )
    ctx.timer.sync()
    backends = {
        "new": CudaBackend(world.pool, world.rows, num_heads=world.num_heads, sliding_window=WINDOW),
        "before": BeforeBackend(world.pool, world.rows, num_heads=world.num_heads, sliding_window=WINDOW),
    }
    ctx.log(
        f"  world: {NUM_LAYERS} layers, context {CONTEXT}, window {WINDOW}, max bs {max(sizes)}; "
        f"cuda backend pdl={backends['new'].pdl} ({backends['new'].pdl_reason})"
    )
    cycles = sleep_cycles_for(SLEEP_MS)
    enqueue_case = (ForwardMode.DECODE, max(sizes))
    md_kernels: List[Tuple[str, object, object, str]] = []
    sync_new: List[Tuple[str, Optional[str]]] = []
    sync_before: List[Optional[str]] = []
    diffs: List[float] = []

    for mode, bs in cases:
        label = f"{mode.name.lower()} bs={bs}"
        if ctx.time_low(45):
            rows.append(row(NAME, label, "host prep time", None, "us", notes="skipped: time budget", key=True))
            continue
        res: Dict[str, Dict[str, object]] = {}
        for path, backend in backends.items():
            try:
                res[path] = _run_path(
                    ctx, rows, world, backend, path, mode, bs, iters, cycles, enqueue=(mode, bs) == enqueue_case
                )
            except Exception as exc:
                rows.append(error_row(NAME, f"{label} {path}", "all", "", exc))
                ctx.log(f"  {label} {path}: FAILED {type(exc).__name__}: {exc}")
            finally:
                free_memory(ctx.timer)
        new, before = res.get("new"), res.get("before")
        if new:
            md_kernels.append((label, new.get("md_kernels"), new.get("md_copies"), (new.get("md_names") or [""])[0]))
            sync_new.append((label, new.get("sync_error")))
            tgt = bs == 128
            detail = f"backend metadata alone {new['md_us']:.1f} us; kernels+copies {new['kernels']}+{new['copies']}"
            if before:
                detail = (
                    f"before {before['prep_us']:.1f} us; metadata alone {new['md_us']:.1f} us; kernels+copies "
                    f"{new['kernels']}+{new['copies']} (before {before['kernels']}+{before['copies']})"
                )
            rows.append(
                row(
                    NAME,
                    label,
                    "host prep time (new)",
                    new["prep_us"],
                    "us",
                    target=f"<= {TARGET_PREP_US:g} us" if tgt else None,
                    met=(new["prep_us"] <= TARGET_PREP_US) if tgt else None,
                    before_us=before["prep_us"] if before else None,
                    detail=detail,
                    key=True,
                )
            )
        if before:
            sync_before.append(before.get("sync_error"))
        if new and before:
            diffs.append((new["output"] - before["output"]).abs().max().item())
            if new["enqueue"] and before["enqueue"]:
                (h_new, _, busy), (h_before, _, _) = new["enqueue"], before["enqueue"]
                rows.append(
                    row(
                        NAME,
                        f"{label}: {ENQUEUE_STEPS} steps behind {SLEEP_MS:g} ms GPU sleep",
                        "host enqueue time (new)",
                        h_new,
                        "ms",
                        target=f"<= {SLEEP_MS / 4:g} ms, GPU still busy",
                        met=h_new <= SLEEP_MS / 4 and busy,
                        key=True,
                        before_ms=h_before,
                        gpu_busy_after_enqueue=busy,
                        detail=f"before {h_before:.2f} ms (blocks on torch.tensor); GPU busy after enqueue: {busy}",
                    )
                )

    if md_kernels:
        bad = [
            f"{label}: " + (f"{k} kernels + {c} copies" if k is not None else first)
            for label, k, c, first in md_kernels
            if (k, c) != (1, 0)
        ]
        counted = [k for _, k, _, _ in md_kernels if k is not None]
        rows.append(
            row(
                NAME,
                f"every case ({len(md_kernels)})",
                "replay-metadata launches",
                max(counted) if counted else None,
                "kernels",
                target="== 1 kernel, 0 copies",
                met=not bad,
                key=True,
                detail="; ".join(bad) if bad else "1 kernel, 0 copies in every case",
            )
        )
    if sync_new:
        raised = [f"{label}: {err}" for label, err in sync_new if err]
        n_before = sum(1 for e in sync_before if e)
        rows.append(
            row(
                NAME,
                f"every case ({len(sync_new)})",
                "syncs in prep + replay (new)",
                len(raised),
                "cases",
                target="0 (set_sync_debug_mode 'error')",
                met=not raised,
                key=True,
                detail="; ".join(raised)
                if raised
                else f"before path raised in {n_before} of {len(sync_before)} cases, as expected",
            )
        )
    if diffs:
        rows.append(
            row(
                NAME,
                f"every case ({len(diffs)})",
                "max |new - before| output",
                max(diffs),
                "",
                target="<= 1e-2",
                met=max(diffs) <= 1e-2,
                detail="same attention, same KV: the two paths must agree",
            )
        )
    return rows
