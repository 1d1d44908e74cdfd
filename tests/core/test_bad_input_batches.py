"""Bad input to the batch / backend API: every case is refused with an error naming the field,
or (on the device path, where no host check runs) has no effect on live KV data.

A small world: two live requests (5 and 7 tokens) prefilled through the backend, then a
DECODE step built from a good template and broken one field at a time. "No effect" compares
every layer's K/V buffers bit for bit (NaN-aware) before and after the step.
"""

from __future__ import annotations

import os

import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from attnplug.backend import BackendConfigError
from attnplug.backends.reference import ReferenceBackend
from attnplug.batch import BatchError

SIZE, SIZE_SWA, MAX_REQS, MAX_CTX, W = 48, 24, 6, 32, 4
PREFILL = [5, 7]


class Env:
    """Pools, two live requests, and a backend; ``decode()`` gives a good DECODE template."""

    def __init__(self, backend_cls=ReferenceBackend, *, head_dim=16, dtype=torch.float32, device="cpu", **backend_kw):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.pool = SWAKVPool(
            size=SIZE,
            size_swa=SIZE_SWA,
            num_layers=3,
            swa_layer_ids=[0, 2],
            num_kv_heads=2,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(MAX_REQS, MAX_CTX, device)
        self.backend = backend_cls(self.pool, self.rows, num_heads=4, sliding_window=W, **backend_kw)
        self.req = [self.rows.alloc() for _ in PREFILL]
        self.lens = list(PREFILL)
        self.live = []  # full slots of the live requests
        loc = self.alloc.alloc(sum(PREFILL))
        start = 0
        for r, n in zip(self.req, PREFILL):
            self.rows.req_to_token[r, :n] = loc[start : start + n].to(torch.int32)
            start += n
        self.live += loc.tolist()
        dev = self.device
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            2,
            torch.tensor(self.req, device=dev),
            torch.tensor(PREFILL, device=dev),
            loc,
            extend_seq_lens=torch.tensor(PREFILL, device=dev),
            extend_seq_lens_cpu=PREFILL,
        )
        self.run(batch)

    def inputs(self, T):
        g = torch.Generator().manual_seed(T)
        d, dt = self.pool.head_dim, self.pool.dtype
        return tuple(torch.randn(T, h, d, generator=g).to(self.device, dt) for h in (4, 2, 2))

    def run(self, batch, init=None):
        """Metadata once, then every layer; returns [T, layers, H, D]."""
        (init or self.backend.init_forward_metadata)(batch)
        q, k, v = self.inputs(batch.num_tokens)
        return torch.stack([self.backend.forward(q, k, v, layer, batch) for layer in range(3)], 1)

    def decode_fields(self):
        """A good DECODE step of both requests (allocates one slot each)."""
        loc = self.alloc.alloc(2)
        for i, r in enumerate(self.req):
            self.rows.req_to_token[r, self.lens[i]] = int(loc[i])
        seq = [n + 1 for n in self.lens]
        return dict(
            forward_mode=ForwardMode.DECODE,
            batch_size=2,
            req_pool_indices=torch.tensor(self.req, device=self.device),
            seq_lens=torch.tensor(seq, device=self.device),
            out_cache_loc=loc,
        )

    def snapshot(self):
        return [t.clone() for layer in range(3) for t in self.pool.get_kv_buffer(layer)]


def _same_bits(a, b):
    return torch.equal(
        a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
        b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32),
    )


# --------------------------------------------------------------------- ForwardBatch (host)
def _t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype)


BATCH_CASES = {
    # id: (change to the good DECODE fields, field the error must name)
    "mode-str": (dict(forward_mode="decode"), "forward_mode"),
    "bs-bool": (dict(batch_size=True), "batch_size"),
    "bs-negative": (dict(batch_size=-1), "batch_size"),
    "bs-too-large": (dict(batch_size=3), "req_pool_indices"),
    "loc-int32": (lambda f: dict(out_cache_loc=f["out_cache_loc"].int()), "out_cache_loc"),
    "loc-float": (lambda f: dict(out_cache_loc=f["out_cache_loc"].float()), "out_cache_loc"),
    "loc-2d": (lambda f: dict(out_cache_loc=f["out_cache_loc"][None]), "out_cache_loc"),
    "loc-below-minus-1": (dict(out_cache_loc=_t([-5, 9])), "out_cache_loc"),
    "rows-float": (lambda f: dict(req_pool_indices=f["req_pool_indices"].float()), "req_pool_indices"),
    "rows-negative": (lambda f: dict(req_pool_indices=_t([-1, f["req_pool_indices"][1]])), "req_pool_indices"),
    "rows-list": (dict(req_pool_indices=[1, 2]), "req_pool_indices"),
    "seq-int16": (lambda f: dict(seq_lens=f["seq_lens"].short()), "seq_lens"),
    "seq-short": (lambda f: dict(seq_lens=f["seq_lens"][:1]), "seq_lens"),
    "positions-int32": (dict(positions=_t([5, 7], torch.int32)), "positions"),
    "positions-length": (dict(positions=_t([5])), "positions"),
    "seq-cpu-length": (dict(seq_lens_cpu=[6]), "seq_lens_cpu"),
    "seq-cpu-float": (dict(seq_lens_cpu=[6.7, 8.0]), "seq_lens_cpu"),
    "seq-cpu-bool": (dict(seq_lens_cpu=[True, 8]), "seq_lens_cpu"),
    "seq-cpu-mismatch": (dict(seq_lens_cpu=[6, 9]), "seq_lens_cpu"),
    "seq-cpu-float-tensor": (dict(seq_lens_cpu=torch.tensor([6.0, 8.0])), "seq_lens_cpu"),
    "decode-ext-2-0": (dict(extend_seq_lens=_t([2, 0])), "extend_seq_lens"),
    "decode-ext-cpu-2-0": (dict(extend_seq_lens_cpu=[2, 0]), "extend_seq_lens_cpu"),
    "decode-seq-zero": (dict(seq_lens=_t([0, 8])), "seq_lens"),
    "extend-no-ext": (dict(forward_mode=ForwardMode.EXTEND), "extend_seq_lens"),
    "extend-sum": (dict(forward_mode=ForwardMode.EXTEND, extend_seq_lens=_t([1, 2])), "extend_seq_lens"),
    "extend-zero": (dict(forward_mode=ForwardMode.EXTEND, extend_seq_lens=_t([2, 0])), "extend_seq_lens"),
    "extend-seq-lt-ext": (
        dict(forward_mode=ForwardMode.EXTEND, extend_seq_lens=_t([1, 1]), seq_lens=_t([0, 8])),
        "seq_lens",
    ),
    "extend-cpu-mirror": (
        dict(forward_mode=ForwardMode.EXTEND, extend_seq_lens=_t([1, 1]), extend_seq_lens_cpu=[2, 0]),
        "extend_seq_lens_cpu",
    ),
    "verify-ndt-0": (dict(forward_mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=0), "num_draft_tokens"),
    "verify-ndt-bool": (dict(forward_mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=True), "num_draft_tokens"),
    "verify-ext": (
        dict(forward_mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=1, extend_seq_lens=_t([1, 2])),
        "extend_seq_lens",
    ),
    "idle-tokens": (
        dict(forward_mode=ForwardMode.IDLE, batch_size=0, req_pool_indices=_t([]), seq_lens=_t([])),
        "IDLE",
    ),
    "decode-bs-0": (dict(batch_size=0, req_pool_indices=_t([]), seq_lens=_t([]), out_cache_loc=_t([])), "batch_size"),
}


@pytest.mark.parametrize("case", list(BATCH_CASES))
def test_forward_batch_refuses(case):
    env = Env()
    fields = env.decode_fields()
    change, field = BATCH_CASES[case]
    fields.update(change(fields) if callable(change) else change)
    before = env.snapshot()
    with pytest.raises(BatchError) as info:
        batch = ForwardBatch(**fields)
        env.run(batch)
    assert field in str(info.value), str(info.value)
    assert all(_same_bits(a, b) for a, b in zip(before, env.snapshot()))


# --------------------------------------------------------------------- against the pools
POOL_CASES = {
    "loc-past-pool": (lambda env, f: dict(out_cache_loc=_t([SIZE + 1, int(f["out_cache_loc"][1])])), "out_cache_loc"),
    "loc-huge": (lambda env, f: dict(out_cache_loc=_t([10**12, int(f["out_cache_loc"][1])])), "out_cache_loc"),
    "row-freed": (lambda env, f: _freed_row(env, f), "req_pool_indices"),
    "row-never-allocated": (lambda env, f: dict(req_pool_indices=_t([env.req[0], MAX_REQS - 1])), "req_pool_indices"),
    "row-past-table": (lambda env, f: dict(req_pool_indices=_t([env.req[0], MAX_REQS + 3])), "req_pool_indices"),
    "seq-past-context": (lambda env, f: dict(seq_lens=_t([6, MAX_CTX + 1])), "seq_lens"),
}


def _freed_row(env, fields):
    row = env.rows.alloc()
    env.rows.free(row)
    return dict(req_pool_indices=_t([env.req[0], row]))


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_backend_refuses_batches_that_do_not_fit_the_pools(case):
    env = Env()
    fields = env.decode_fields()
    change, field = POOL_CASES[case]
    fields.update(change(env, fields))
    before = env.snapshot()
    with pytest.raises(BatchError) as info:
        env.run(ForwardBatch(**fields))
    assert field in str(info.value), str(info.value)
    assert all(_same_bits(a, b) for a, b in zip(before, env.snapshot()))


def test_backend_refuses_a_batch_on_another_device():
    env = Env()
    meta = lambda x: torch.tensor(x, device="meta")  # noqa: E731
    batch = ForwardBatch(ForwardMode.DECODE, 1, meta([env.req[0]]), meta([6]), meta([3]))
    with pytest.raises(BatchError, match="out_cache_loc is on meta"):
        env.backend.init_forward_metadata(batch)


# --------------------------------------------------------------------- forward()
def test_forward_refuses_a_batch_other_than_the_prepared_one():
    env = Env()
    good = ForwardBatch(**env.decode_fields())
    env.backend.init_forward_metadata(good)
    other = ForwardBatch(**env.decode_fields())  # another step: other slots
    before = env.snapshot()
    q, k, v = env.inputs(2)
    with pytest.raises(BatchError, match="prepared"):
        env.backend.forward(q, k, v, 0, other)
    assert all(_same_bits(a, b) for a, b in zip(before, env.snapshot()))
    env.backend.forward(q, k, v, 0, good)  # the prepared one still runs


def test_forward_before_metadata():
    env = Env()
    backend = ReferenceBackend(env.pool, env.rows, num_heads=4, sliding_window=W)
    q, k, v = env.inputs(2)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, k, v, 0, ForwardBatch(**env.decode_fields()))


FORWARD_CASES = {
    "q-int64": (lambda q, k, v: (q.long(), k, v), "q"),
    "q-float16": (lambda q, k, v: (q.half(), k, v), "q"),
    "k-float64": (lambda q, k, v: (q, k.double(), v), "k"),
    "v-int32": (lambda q, k, v: (q, k, v.int()), "v"),
    "q-heads": (lambda q, k, v: (q[:, :2], k, v), "q"),
    "k-tokens": (lambda q, k, v: (q, k[:1], v), "k"),
    "v-head-dim": (lambda q, k, v: (q, k, v[..., :8]), "v"),
    "k-list": (lambda q, k, v: (q, k.tolist(), v), "k"),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_refuses_bad_tensors(case):
    env = Env()
    batch = ForwardBatch(**env.decode_fields())
    env.backend.init_forward_metadata(batch)
    change, name = FORWARD_CASES[case]
    q, k, v = change(*env.inputs(2))
    before = env.snapshot()
    with pytest.raises(ValueError) as info:
        env.backend.forward(q, k, v, 0, batch)
    assert str(info.value).startswith(name + " "), str(info.value)
    assert all(_same_bits(a, b) for a, b in zip(before, env.snapshot()))


@pytest.mark.parametrize("scaling", [float("nan"), float("inf"), -float("inf"), 0.0, -0.5, True, "0.1"])
def test_backend_refuses_bad_scaling(scaling):
    env = Env()
    with pytest.raises(BackendConfigError, match="scaling"):
        ReferenceBackend(env.pool, env.rows, num_heads=4, sliding_window=W, scaling=scaling)


def test_backend_refuses_an_integer_kv_pool():
    env = Env()
    env.pool.dtype = torch.int32  # a pool whose KV is not floating point
    with pytest.raises(BackendConfigError, match="dtype"):
        ReferenceBackend(env.pool, env.rows, num_heads=4, sliding_window=W)


# --------------------------------------------------------------------- the device path
# On an accelerator the values are never read on the host (unless ATTNPLUG_VALIDATE=1): what
# the device code does with them is what protects the cache. Here the host check is switched
# off so the CPU runs exactly that path (the cuda backend: under the Triton interpreter on the
# host, on the GPU where there is one).
def _backends():
    out = [pytest.param((ReferenceBackend, 16, torch.float32, "cpu"), id="reference")]
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreting or torch.cuda.is_available():
        from attnplug_cuda.backend import CudaBackend

        device = "cpu" if interpreting else "cuda"  # the kernels run on the host only interpreted
        out.append(pytest.param((CudaBackend, 64, torch.float16, device), id="cuda"))
    return out


DEVICE_CASES = {
    "loc-minus-1": lambda env, f: dict(out_cache_loc=_t([-1, -1])),
    "loc-past-pool": lambda env, f: dict(out_cache_loc=_t([SIZE + 1, SIZE + 100])),
    "loc-negative": lambda env, f: dict(out_cache_loc=_t([-7, -(SIZE + 1)])),
    "loc-sink": lambda env, f: dict(out_cache_loc=_t([0, 0])),
    "row-minus-1": lambda env, f: (
        _last_row_holds_keys(env) or dict(req_pool_indices=_t([-1, -1]), out_cache_loc=_t([-1, -1]))
    ),
    "row-past-table": lambda env, f: dict(req_pool_indices=_t([MAX_REQS + 3, 10**9]), out_cache_loc=_t([-1, -1])),
}


def _last_row_holds_keys(env):
    """Make a -1 wrap visible: the table's last row points at live keys."""
    env.rows.req_to_token[-1] = env.rows.req_to_token[env.req[1]]


@pytest.fixture(params=_backends())
def device_env(request, monkeypatch):
    cls, d, dtype, device = request.param
    env = Env(cls, head_dim=d, dtype=dtype, device=device)
    monkeypatch.setattr(env.backend, "check_batch", lambda *a, **k: None)  # as on a device, validation off
    return env


@pytest.mark.parametrize("case", list(DEVICE_CASES))
def test_device_path_never_writes_or_reads_outside(device_env, case):
    """Slots outside [1, S) are never written (the last slot of each pool included: no -1
    wrap); a row outside the table reads nothing; outputs stay finite."""
    env = device_env
    fields = env.decode_fields()
    fields.update({k: v.to(env.device) for k, v in DEVICE_CASES[case](env, fields).items()})
    before = env.snapshot()
    out = env.run(ForwardBatch(**fields, validate=False))  # device values: ForwardBatch cannot read them
    for a, b in zip(before, env.snapshot()):
        assert _same_bits(a, b), "a KV buffer changed"
    assert torch.isfinite(out).all()
    if case.startswith("row"):
        assert (out == 0).all()  # no key reachable: zeros


def test_sink_and_free_slots_full_of_nan_never_reach_an_output(device_env):
    """Slot 0 (the padding sink) and every free slot hold NaN/Inf: the outputs of the live
    requests are finite and equal to the same step on a clean cache."""
    env = device_env
    clean = Env(type(env.backend), head_dim=env.pool.head_dim, dtype=env.pool.dtype, device=env.device)
    batch_fields = env.decode_fields()
    clean_fields = clean.decode_fields()
    assert torch.equal(batch_fields["out_cache_loc"], clean_fields["out_cache_loc"])
    new = batch_fields["out_cache_loc"].tolist()
    for layer in range(3):
        full_live = torch.tensor(env.live + new, device=env.device)
        live = env.pool.translate_loc_from_full_to_swa(full_live).long() if env.pool.is_swa_layer(layer) else full_live
        for buf, poison in zip(env.pool.get_kv_buffer(layer), (float("inf"), float("nan"))):
            keep = buf[live].clone()
            buf.fill_(float("nan"))
            buf[0] = poison
            buf[live] = keep
    want = clean.run(ForwardBatch(**clean_fields))
    got = env.run(ForwardBatch(**batch_fields))
    assert torch.isfinite(got).all(), "NaN/Inf from the sink or a free slot reached an output"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_padded_requests_of_a_step_leave_the_sink_harmless(device_env):
    """A padded request (row 0, slot 0, seq_len 1) next to a real one: the real output equals
    the step without padding, whatever the sink holds."""
    env = device_env
    clean = Env(type(env.backend), head_dim=env.pool.head_dim, dtype=env.pool.dtype, device=env.device)
    fields, clean_fields = env.decode_fields(), clean.decode_fields()
    for layer in range(3):
        for buf in env.pool.get_kv_buffer(layer):
            buf[0] = float("nan")
    dev = env.device
    pad = dict(
        batch_size=3,
        req_pool_indices=torch.cat([fields["req_pool_indices"], _t([0]).to(dev)]),
        seq_lens=torch.cat([fields["seq_lens"], _t([1]).to(dev)]),
        out_cache_loc=torch.cat([fields["out_cache_loc"], _t([0]).to(dev)]),
    )
    fields.update(pad)
    q, k, v = env.inputs(3)
    env.backend.init_forward_metadata(batch := ForwardBatch(**fields))
    got = torch.stack([env.backend.forward(q, k, v, layer, batch) for layer in range(3)], 1)
    clean.backend.init_forward_metadata(cb := ForwardBatch(**clean_fields))
    want = torch.stack([clean.backend.forward(q[:2], k[:2], v[:2], layer, cb) for layer in range(3)], 1)
    assert torch.isfinite(got[:2]).all()
    torch.testing.assert_close(got[:2], want, rtol=0, atol=0)


# --------------------------------------------------------------------- validation mode
def test_validation_mode_checks_replay(monkeypatch):
    """ATTNPLUG_VALIDATE=1: graph-replay metadata reads the batch and refuses a bad slot;
    without it replay reads nothing and the device path keeps the cache intact."""
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    env = Env()
    env.backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    fields = env.decode_fields()
    fields["out_cache_loc"] = _t([SIZE + 5, int(fields["out_cache_loc"][1])])
    with pytest.raises(BatchError, match="out_cache_loc"):
        env.backend.init_forward_metadata_replay_cuda_graph(ForwardBatch(**fields))

    monkeypatch.delenv("ATTNPLUG_VALIDATE")
    env = Env()
    env.backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    fields = env.decode_fields()
    fields["out_cache_loc"] = _t([SIZE + 5, -1])
    before = env.snapshot()
    out = env.run(ForwardBatch(**fields, validate=False), init=env.backend.init_forward_metadata_replay_cuda_graph)
    assert torch.isfinite(out).all()
    assert all(_same_bits(a, b) for a, b in zip(before, env.snapshot()))


def test_validation_does_not_change_the_batch():
    """Validation assigns nothing: a given extend_seq_lens stays the very same tensor."""
    ext = _t([3, 3])
    b = ForwardBatch(
        ForwardMode.TARGET_VERIFY,
        2,
        _t([1, 2]),
        _t([8, 9]),
        _t(list(range(1, 7))),
        extend_seq_lens=ext,
        num_draft_tokens=3,
    )
    assert b.extend_seq_lens is ext and torch.equal(ext, _t([3, 3]))
