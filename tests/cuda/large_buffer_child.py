"""The cuda kernels over buffers past 2**31 elements: run as a child process by
``test_cuda_worlds_interpreted.py`` (a 32-bit offset that wraps there writes or reads outside the
buffer, which can kill the process), ``python large_buffer_child.py CASE``.

On the host (the Triton interpreter, which multiplies 32-bit integers in 32 bits as a compiled
kernel does) the buffers are ``torch.empty`` views of one lazily committed allocation: only the
pages the kernels touch take memory. Cases:

* ``slots``: contiguous ``[S, Hkv, D]`` caches of more than 2**31 elements, every key and every
  stored row at a slot past element 2**31 (``slot * Hkv * D``): ``kv_store``,
  ``paged_attention`` (storing the step, and with KV splits), ``store_attend`` (decode with its
  own key, a verify with splits), and on a CUDA device that builds it the C++ store;
* ``heads``: head-major views (the head stride a 32-bit int, a head index times it past 2**31):
  the caches through ``kv_store``'s strided path and ``paged_attention``, q and out through
  ``paged_attention`` (and its split combine) and ``store_attend``.

Every output is compared with float64 attention (``attnplug.oracle.exact_attention``); exit
status 0 when all match, 1 on a mismatch, ``SKIP`` when the memory cannot be reserved.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnplug.oracle import exact_attention  # noqa: E402
from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, NewRows, num_sms  # noqa: E402
from attnplug_cuda.kernels.kv_store import kv_store  # noqa: E402
from attnplug_cuda.kernels.paged_attention import paged_attention  # noqa: E402
from attnplug_cuda.kernels.store_attend import store_attend  # noqa: E402
from attnplug_cuda.planner import LaunchShape, one_launch_workspace_numel, plan_one_launch, plan_paged  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402

#: exit status when the buffers cannot be reserved (the test skips)
SKIP = 77
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float16
TOL = 4e-3
BOUNDARY = 2**31
TUNING = CudaTuning()


def reserve(numel: int) -> torch.Tensor:
    try:
        return torch.empty(numel, dtype=DTYPE, device=DEVICE)
    except (RuntimeError, MemoryError) as exc:
        print(f"cannot reserve {numel * 2 / 2**30:.1f} GiB on {DEVICE}: {exc}")
        sys.exit(SKIP)


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)


class Checks:
    def __init__(self):
        self.failed = []

    def close(self, what, out, exact):
        a = out.detach().to("cpu", torch.float64)
        err = float(((a - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-3)).max())
        ok = bool(torch.isfinite(a).all()) and err <= TOL
        print(f"{what}: relative error {err:.3g}{'' if ok else '  <-- FAIL'}", flush=True)
        if not ok:
            self.failed.append(what)

    def equal(self, what, a, b):
        ok = torch.equal(a.cpu(), b.cpu())
        print(f"{what}: {'equal' if ok else 'DIFFERENT  <-- FAIL'}", flush=True)
        if not ok:
            self.failed.append(what)


def expected(q, hist_k, hist_v, q_lens):
    """float64 attention of the step (``q``: its rows, request by request; ``hist_*``: each
    request's keys, the step's own last)."""
    keys = torch.nn.utils.rnn.pad_sequence([k.cpu().double() for k in hist_k], batch_first=True)
    values = torch.nn.utils.rnn.pad_sequence([v.cpu().double() for v in hist_v], batch_first=True)
    lens = [k.shape[0] for k in hist_k]
    return exact_attention(q.cpu().double(), keys, values, lens, q_lens, None, q.shape[-1] ** -0.5)


def paged(q, kc, vc, out, q_lens, seq_lens, table, *, new=None, splits=None):
    T, H, D = q.shape
    hkv = kc.shape[1]
    bs = len(q_lens)
    shape = LaunchShape(bs, T, hkv, H // hkv, D, max(q_lens), table.shape[1], None, num_sms(q.device))
    plan = plan_paged(shape, TUNING)
    if splits:
        plan = plan._replace(NUM_SPLITS=splits)
    cu = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(bs)], dtype=torch.int32, device=DEVICE)
    rows = torch.arange(1, bs + 1, dtype=torch.int32, device=DEVICE)
    inputs = AttentionInputs(cu, torch.tensor(seq_lens, device=DEVICE), KeyTable.of(table, rows), max(q_lens))
    return paged_attention(q, kc, vc, out, inputs, plan, new=new)


def one_launch(q, k, v, loc, kc, vc, out, q_len, seq_lens, table, *, splits=1):
    T, H, D = q.shape
    hkv = kc.shape[1]
    bs = len(seq_lens)
    shape = LaunchShape(bs, T, hkv, H // hkv, D, q_len, table.shape[1], None, num_sms(q.device))
    plan = plan_one_launch(shape, TUNING)
    plan = plan._replace(NUM_SPLITS=splits, MERGE_CHUNK=min(plan.MERGE_CHUNK, splits))
    cu = torch.arange(0, (bs + 1) * q_len, q_len, dtype=torch.int32, device=DEVICE)
    rows = torch.arange(1, bs + 1, dtype=torch.int32, device=DEVICE)
    inputs = AttentionInputs(cu, torch.tensor(seq_lens, device=DEVICE), KeyTable.of(table, rows), q_len)
    work = torch.empty(one_launch_workspace_numel(D, num_sms(q.device), TUNING), dtype=torch.float32, device=DEVICE)
    tickets = torch.zeros(bs * hkv, dtype=torch.int32, device=DEVICE)
    return store_attend(q, k, v, loc, kc, vc, out, inputs, plan, workspace=work, tickets=tickets)


def attention_cases(c, kc, vc, slots, q_view, gen, *, G, one_launch_caches=None):
    """The attention kernels over caches ``kc`` / ``vc`` at ``slots`` (at least 60), q and out
    from ``q_view(T, H, out)`` (a new view each call)."""
    hkv, D = kc.shape[1], kc.shape[2]
    H = hkv * G
    seq_lens, q_lens = [37, 23], [3, 2]
    hist_k = [rand(s, hkv, D, gen=gen) for s in seq_lens]
    hist_v = [rand(s, hkv, D, gen=gen) for s in seq_lens]
    table = torch.zeros(len(seq_lens) + 1, 48, dtype=torch.int32, device=DEVICE)
    used = 0
    for b, s in enumerate(seq_lens):
        table[b + 1, :s] = slots[used : used + s].to(torch.int32)
        used += s
    # every cached row but the step's own through kv_store (the step's own: stored by the kernel)
    for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
        kc[table[b + 1, : s - n].long()] = float("nan")
        kv_store(hist_k[b][: s - n], hist_v[b][: s - n], kc, vc, table[b + 1, : s - n].long())
        c.equal(f"kv_store request {b}", kc[table[b + 1, : s - n].long()], hist_k[b][: s - n])
    new_k = torch.cat([hk[s - n :] for hk, s, n in zip(hist_k, seq_lens, q_lens)])
    new_v = torch.cat([hv[s - n :] for hv, s, n in zip(hist_v, seq_lens, q_lens)])
    loc = torch.cat([table[b + 1, s - n : s].long() for b, (s, n) in enumerate(zip(seq_lens, q_lens))])
    T = sum(q_lens)
    q = q_view(T, H)
    q.copy_(rand(T, H, D, gen=gen))
    exact = expected(q, hist_k, hist_v, q_lens)
    for splits in (None, 3):
        kc[loc], vc[loc] = float("nan"), float("nan")
        out = q_view(T, H, out=True)
        paged(q, kc, vc, out, q_lens, seq_lens, table, new=NewRows.of(new_k, new_v, loc), splits=splits)
        c.close(f"paged_attention storing the step, splits {splits}", out, exact)
        c.equal(f"paged_attention's stored rows, splits {splits}", kc[loc], new_k)
    if one_launch_caches is not None:  # store_attend needs contiguous caches: its own
        kc, vc = one_launch_caches
    else:
        kc[loc], vc[loc] = float("nan"), float("nan")
    if one_launch_caches is not None:
        for b, (s, n) in enumerate(zip(seq_lens, q_lens)):
            kv_store(hist_k[b][: s - n], hist_v[b][: s - n], kc, vc, table[b + 1, : s - n].long())
    # decode (the own key folded as a vector) and a two-token step with KV splits
    for q_len, splits in ((1, 1), (2, 2)):
        lens = [s - (n - q_len) for s, n in zip(seq_lens, q_lens)]
        hk = [h[:s] for h, s in zip(hist_k, lens)]
        hv = [h[:s] for h, s in zip(hist_v, lens)]
        rows = torch.cat([torch.arange(sum(q_lens[:b]), sum(q_lens[:b]) + q_len) for b in range(len(q_lens))])
        qs = q_view(len(lens) * q_len, H)
        qs.copy_(q[rows.to(DEVICE)])
        out = q_view(len(lens) * q_len, H, out=True)
        one_launch(qs, new_k[rows.to(DEVICE)], new_v[rows.to(DEVICE)], loc[rows.to(DEVICE)], kc, vc, out, q_len,
                   lens, table, splits=splits)  # fmt: skip
        c.close(f"store_attend q_len {q_len}, splits {splits}", out, expected(qs, hk, hv, [q_len] * len(lens)))


def case_slots(c, gen):
    hkv, D, G = 8, 64, 2
    row = hkv * D
    first = -(-BOUNDARY // row)  # the first slot at an element offset >= 2**31
    S = first + 96
    store = reserve(2 * S * row)
    kc = store[: S * row].view(S, hkv, D)
    vc = store[S * row :].view(S, hkv, D)
    slots = (first + torch.randperm(95, generator=gen)).to(DEVICE)
    assert int(slots.min()) * row >= BOUNDARY
    dense = lambda T, H, out=False: torch.empty(T, H, D, dtype=DTYPE, device=DEVICE)  # noqa: E731
    attention_cases(c, kc, vc, slots, dense, gen, G=G)
    cpp = _cpp_store()
    if cpp is not None:  # the C++ store (a CUDA device that builds it) at the same slots
        k, v = rand(slots.numel(), hkv, D, gen=gen), rand(slots.numel(), hkv, D, gen=gen)
        kc[slots], vc[slots] = float("nan"), float("nan")
        cpp(k, v, kc, vc, slots)
        c.equal("the C++ store", torch.cat([kc[slots], vc[slots]]), torch.cat([k, v]))


def _cpp_store():
    if DEVICE.type != "cuda":
        return None
    from attnplug_cuda.cpp_ext import kv_store as cpp_kv_store
    from attnplug_cuda.cpp_ext import try_load_ext

    if try_load_ext() is None:
        print("the C++ store does not build here: not run")
        return None
    return cpp_kv_store


def case_heads(c, gen):
    hkv, D, G = 3, 64, 2
    S, T_max = 128, 8
    head_kv = 2**30 + 2**20  # a 32-bit int; kv head 2 starts past element 2**31
    head_q = head_kv // 2  # q heads 4 and 5 start past element 2**31
    store = reserve(hkv * head_kv)
    kc = store.as_strided((S, hkv, D), (D, head_kv, 1), 0)
    vc = store.as_strided((S, hkv, D), (D, head_kv, 1), S * D)

    regions = iter(range(8))  # q and out of each launch: regions of their own in every head's span

    def q_view(T, H, out=False):
        assert T <= T_max
        return store.as_strided((T, H, D), (D, head_q, 1), 2 * S * D + next(regions) * T_max * D)

    assert 2 * head_kv >= BOUNDARY and 4 * head_q >= BOUNDARY and head_kv < BOUNDARY
    slots = (1 + torch.randperm(S - 1, generator=gen)).to(DEVICE)
    caches = (torch.empty(S, hkv, D, dtype=DTYPE, device=DEVICE), torch.empty(S, hkv, D, dtype=DTYPE, device=DEVICE))
    attention_cases(c, kc, vc, slots, q_view, gen, G=G, one_launch_caches=caches)


if __name__ == "__main__":
    name = sys.argv[1]
    checks = Checks()
    {"slots": case_slots, "heads": case_heads}[name](checks, torch.Generator().manual_seed(0))
    if checks.failed:
        print(f"FAILED: {checks.failed}")
        sys.exit(1)
    print("all match")
