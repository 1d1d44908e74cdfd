"""Micro-benchmark of the kernels on one GPU (``python -m attnplug_cuda.kernels.bench``).

Times device work as the median of CUDA-graph replays (``do_bench_cudagraph``: no host
launch gaps) and, separately, the host time to enqueue one call (what eager mode pays), with
slots scattered at random through a cache far larger than L2:

* SWA decode, the target case: bs=64, window 4096, 32 q / 8 kv heads, D=128, bf16 (about
  1.07 GB of K/V read per call), against the device's copy bandwidth;
* full-layer decode over ``req_to_token``, TARGET_VERIFY (q_len 4), a long prefill;
* ``kv_store`` and ``step_metadata``;
* ``--sweep``: block sizes / warps / stages / splits of the SWA decode case.

Each attention case is also checked against a float32 torch computation. Prints a table and,
with ``--json PATH``, writes every number there.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def _copy_bandwidth(device) -> float:
    import triton.testing as tt

    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def _case(bs, q_len, seq_len, window, H, Hkv, D, dtype, device, layer, seed=0):
    """Caches, tables and inputs of one uniform step (every request the same lengths)."""
    from .step_metadata import step_metadata

    g = torch.Generator(device=device).manual_seed(seed)
    reach = seq_len if window is None else min(seq_len, q_len + window - 1)
    n_slots = bs * (seq_len if layer == "full" else reach) + 1
    k_cache = torch.randn(n_slots, Hkv, D, generator=g, device=device).to(dtype)
    v_cache = torch.randn(n_slots, Hkv, D, generator=g, device=device).to(dtype)
    perm = torch.randperm(n_slots - 1, generator=g, device=device).int() + 1
    max_ctx = seq_len + 8
    req_to_token = torch.zeros(bs + 1, max_ctx, dtype=torch.int32, device=device)
    mapping = torch.zeros(bs * seq_len + 2, dtype=torch.int32, device=device)
    full = torch.arange(1, bs * seq_len + 1, device=device).view(bs, seq_len).int()
    req_to_token[1:, :seq_len] = full
    if layer == "full":
        mapping[1 : bs * seq_len + 1] = perm[: bs * seq_len]  # unused by the full layer
        req_to_token[1:, :seq_len] = perm[: bs * seq_len].view(bs, seq_len)
    else:
        mapping[full[:, seq_len - reach :].reshape(-1).long()] = perm[: bs * reach]
    rpi = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    seq_lens = torch.full((bs,), seq_len, dtype=torch.int32, device=device)
    T = bs * q_len
    out_cache_loc = req_to_token[1:, seq_len - q_len : seq_len].reshape(-1).long()
    width = q_len + window - 1 if window is not None else max_ctx
    bufs = dict(
        cu_q_lens=torch.empty(bs + 1, dtype=torch.int32, device=device),
        window_start=torch.empty(bs, dtype=torch.int32, device=device),
        token_pos=torch.empty(T, dtype=torch.int32, device=device),
        swa_out_cache_loc=torch.empty(T, dtype=torch.int32, device=device),
        swa_window_table=torch.empty(bs, width, dtype=torch.int32, device=device) if window is not None else None,
    )
    meta = lambda: step_metadata(  # noqa: E731
        rpi, seq_lens, q_len, out_cache_loc, full_to_swa_index_mapping=mapping, req_to_token=req_to_token,
        window=window, **bufs,
    )
    meta()
    q = torch.randn(T, H, D, generator=g, device=device).to(dtype)
    if layer == "full":
        table, rows, start = req_to_token, rpi, None
    else:
        table, rows, start = bufs["swa_window_table"], torch.arange(bs, dtype=torch.int32, device=device), bufs["window_start"]
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu=bufs["cu_q_lens"], seq_lens=seq_lens, table=table,
                rows=rows, start=start, max_kv_len=max_ctx, meta=meta, reach=reach, out_cache_loc=out_cache_loc)


def _reference(c, q_len, window):
    """float32 dense attention over the slots the table names (one request at a time)."""
    q, kc, vc = c["q"], c["k_cache"], c["v_cache"]
    T, H, D = q.shape
    Hkv = kc.shape[1]
    bs = c["seq_lens"].shape[0]
    seq_len = int(c["seq_lens"][0])
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    start = c["start"]
    for b in range(bs):
        lo_col = 0 if start is None else int(start[b])
        row = int(c["rows"][b])
        pos_all = torch.arange(lo_col, seq_len, device=q.device)
        slots = c["table"][row, pos_all - lo_col].long()
        k = kc[slots].float().repeat_interleave(H // Hkv, 1)
        v = vc[slots].float().repeat_interleave(H // Hkv, 1)
        qb = q[b * q_len : (b + 1) * q_len].float()
        s = torch.einsum("thd,jhd->thj", qb, k) / math.sqrt(D)
        p = seq_len - q_len + torch.arange(q_len, device=q.device)
        keep = pos_all[None, :] <= p[:, None]
        if window is not None:
            keep &= pos_all[None, :] >= (p - window + 1)[:, None]
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        out[b * q_len : (b + 1) * q_len] = torch.einsum("thj,jhd->thd", torch.softmax(s, -1), v)
    return out


def _graph_ms(fn) -> float:
    """Median device time of one call, replayed from a CUDA graph (no host launch gaps)."""
    import triton.testing as tt

    return tt.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _host_us(fn, n=200) -> float:
    """Host time to enqueue one call (what eager mode pays per launch)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _time_attention(c, q_len, window, *, config=None, pdl=False, check=True, host=False):

    from .paged_attention import paged_attention, workspace_numel

    q = c["q"]
    out = torch.empty_like(q)
    ws = torch.empty(workspace_numel(q.shape[0], q.shape[1], q.shape[2]) * 4, dtype=torch.float32, device=q.device)
    fn = lambda: paged_attention(  # noqa: E731
        q, c["k_cache"], c["v_cache"], out, cu_q_lens=c["cu"], seq_lens=c["seq_lens"], table=c["table"],
        table_rows=c["rows"], table_start=c["start"], max_q_len=q_len, max_kv_len=c["max_kv_len"], window=window,
        workspace=ws, pdl=pdl, config=config,
    )
    fn()
    err = None
    if check:
        ref = _reference(c, q_len, window)
        err = float((out.float() - ref).norm() / ref.norm())
    ms = _graph_ms(fn)
    if host:
        return ms, err, _host_us(fn)
    return ms, err


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import triton

    from .kv_store import kv_store
    from .paged_attention import _num_sms, plan_attention
    from .pdl import pdl_supported

    device = torch.device("cuda", torch.cuda.current_device())
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
               "pdl": pdl_supported(device)}
    bw = _copy_bandwidth(device)
    results["copy_bw_TBps"] = bw / 1e12
    rows = []
    H, Hkv, D, dt = 32, 8, 128, torch.bfloat16
    pdl = pdl_supported(device)[0]

    def attn_row(name, bs, q_len, seq_len, window, layer, config=None, check=True):
        c = _case(bs, q_len, seq_len, window, H, Hkv, D, dt, device, layer)
        keys = min(seq_len, q_len + window - 1) if window is not None else seq_len
        kv_bytes = bs * keys * Hkv * D * 2 * 2
        plan = plan_attention(num_reqs=bs, num_tokens=bs * q_len, num_kv_heads=Hkv, group=H // Hkv, head_dim=D,
                              max_q_len=q_len, max_kv_len=c["max_kv_len"], window=window,
                              num_sms=_num_sms(device.type, device.index))
        if config:
            plan.update(config)
        ms, err, host = _time_attention(c, q_len, window, config=config, pdl=pdl, check=check, host=True)
        flops = 4 * bs * q_len * H * D * (keys if q_len == 1 else (keys - q_len / 2))
        row = dict(name=name, us=ms * 1e3, kv_GB=kv_bytes / 1e9, TBps=kv_bytes / (ms * 1e-3) / 1e12,
                   TFLOPs=flops / (ms * 1e-3) / 1e12, rel_err=err, plan=plan, host_us=host)
        rows.append(row)
        del c
        torch.cuda.empty_cache()
        return row

    attn_row("swa_decode bs64 W4096 seq8192", 64, 1, 8192, 4096, "swa")
    attn_row("full_decode bs64 seq4096", 64, 1, 4096, None, "full")
    attn_row("swa_decode bs8 W4096 seq8192", 8, 1, 8192, 4096, "swa")
    attn_row("swa_decode bs256 W4096 seq4096", 256, 1, 4096, 4096, "swa", check=False)
    attn_row("swa_verify bs64 q4 W4096", 64, 4, 8192, 4096, "swa")
    attn_row("full_prefill bs1 q8192", 1, 8192, 8192, None, "full", check=False)
    attn_row("full_extend bs4 q2048 prefix2048", 4, 2048, 4096, None, "full", check=False)

    # a 32-layer decode step (kv_store + attention per layer) in one graph, PDL off / on
    from .paged_attention import paged_attention, workspace_numel

    c = _case(8, 1, 2048, 1024, H, Hkv, D, dt, device, "swa")
    k_new = torch.randn(8, Hkv, D, device=device).to(dt)
    loc = torch.arange(1, 9, dtype=torch.int32, device=device)
    out = torch.empty_like(c["q"])
    ws = torch.empty(workspace_numel(8, H, D), dtype=torch.float32, device=device)
    for use_pdl in ([False, True] if pdl else [False]):
        def step(use_pdl=use_pdl, c=c):
            for _ in range(32):
                kv_store(k_new, k_new, c["k_cache"], c["v_cache"], loc, pdl=use_pdl)
                paged_attention(c["q"], c["k_cache"], c["v_cache"], out, cu_q_lens=c["cu"], seq_lens=c["seq_lens"],
                                table=c["table"], table_rows=c["rows"], table_start=c["start"], max_q_len=1,
                                max_kv_len=c["max_kv_len"], window=1024, workspace=ws, pdl=use_pdl)
        step()
        rows.append(dict(name=f"32-layer decode step bs8 W1024 pdl={use_pdl}", us=_graph_ms(step) * 1e3))
    del c

    if args.sweep:
        for bs in (8, 32, 64):
            c = _case(bs, 1, 8192, 4096, H, Hkv, D, dt, device, "swa")
            kv_bytes = bs * 4096 * Hkv * D * 4
            variants = [dict(num_splits=sp) for sp in (1, 2, 3, 4, 6, 8, 12, 16)]
            if bs == 64:
                variants += [dict(num_splits=1, num_stages=2), dict(num_splits=1, PHASES=True),
                             dict(num_splits=2, PHASES=True), dict(num_splits=1, BLOCK_N=128, num_warps=8)]
            for cfg in variants:
                try:
                    ms, _ = _time_attention(c, 1, 4096, config=cfg, pdl=pdl, check=False)
                except Exception as exc:  # out of shared memory etc.
                    rows.append(dict(name=f"sweep decode bs{bs} {cfg}", error=repr(exc)[:200]))
                    continue
                rows.append(dict(name=f"sweep decode bs{bs} {cfg}", us=ms * 1e3, TBps=kv_bytes / (ms * 1e-3) / 1e12))
            del c
            torch.cuda.empty_cache()
        c = _case(1, 8192, 8192, None, H, Hkv, D, dt, device, "full")
        flops = 4 * 8192 * H * D * 8192 / 2
        for cfg in (dict(PHASES=False), dict(PHASES=True), dict(PHASES=True, num_stages=3),
                    dict(PHASES=True, BLOCK_M=64, num_warps=4, num_stages=3), dict(PHASES=True, BLOCK_N=128),
                    dict(PHASES=True, BLOCK_N=32, num_stages=3)):
            try:
                ms, _ = _time_attention(c, 8192, None, config=cfg, pdl=pdl, check=False)
            except Exception as exc:
                rows.append(dict(name=f"sweep prefill {cfg}", error=repr(exc)[:200]))
                continue
            rows.append(dict(name=f"sweep prefill {cfg}", us=ms * 1e3, TFLOPs=flops / (ms * 1e-3) / 1e12))
        del c
        torch.cuda.empty_cache()

    # kv_store: 64 decode tokens and an 8192-token prefill, 8 kv heads x 128, bf16
    for T in (64, 8192):
        S = 1 << 20
        kc = torch.zeros(S, Hkv, D, dtype=dt, device=device)
        vc = torch.zeros_like(kc)
        k = torch.randn(T, Hkv, D, device=device).to(dt)
        v = torch.randn_like(k)
        loc = torch.randperm(S, device=device)[:T]
        kv_store(k, v, kc, vc, loc, pdl=pdl)
        assert torch.equal(kc[loc], k) and torch.equal(vc[loc], v)
        fn = lambda: kv_store(k, v, kc, vc, loc, pdl=pdl)  # noqa: E731
        ms = _graph_ms(fn)
        rows.append(dict(name=f"kv_store T={T}", us=ms * 1e3, TBps=4 * k.numel() * 2 / (ms * 1e-3) / 1e12,
                         host_us=_host_us(fn)))
    for bs in (64, 1024):
        c = _case(bs, 1, 4200, 4096, 8, 8, 64, dt, device, "swa")
        ms = _graph_ms(c["meta"])
        rows.append(dict(name=f"step_metadata decode bs={bs} W4096", us=ms * 1e3, host_us=_host_us(c["meta"])))
        del c

    results["rows"] = rows
    print(f"{results['device']}  torch {results['torch']}  triton {results['triton']}  pdl {results['pdl']}")
    print(f"copy bandwidth {results['copy_bw_TBps']:.2f} TB/s (read + write)")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<58} ERROR {r['error']}")
            continue
        extra = ""
        if "TBps" in r:
            extra += f" {r['TBps']:6.2f} TB/s"
        if "TFLOPs" in r:
            extra += f" {r['TFLOPs']:7.1f} TFLOP/s"
        if r.get("rel_err") is not None:
            extra += f" err {r['rel_err']:.1e}"
        if r.get("host_us") is not None:
            extra += f" host {r['host_us']:.0f} us"
        if "plan" in r:
            p = r["plan"]
            extra += f"  M{p['BLOCK_M']} N{p['BLOCK_N']} w{p['num_warps']} s{p['num_stages']} sp{p['num_splits']}"
            extra += f" ph{int(p['PHASES'])}"
        print(f"{r['name']:<58} {r['us']:8.1f} us{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"bench took {time.time() - t0:.0f} s")
