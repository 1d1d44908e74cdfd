"""The op layer's contract (``attnplug.ops``) beyond what the conformance check samples: the
slot table ``plan`` builds, the layouts a cache may have, refusals that name the argument and
write nothing, integers of any kind, and one copy of the math for the pool backend and the ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.backends.portable import PortableBackend
from attnplug.backends.reference import ReferenceBackend
from attnplug.ops import OpsInputError, PortableOps
from attnplug.ops import portable as ops_portable
from attnplug.ops.base import flat_cache


def _plan(ops, seq, q_lens, table, block_size, **kw):
    qsl = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    return ops.plan(
        qsl,
        torch.tensor(seq, dtype=torch.int32),
        torch.tensor(table, dtype=torch.int32),
        block_size,
        num_tokens=kw.pop("num_tokens", sum(q_lens)),
        max_query_len=max(q_lens),
        max_seq_len=kw.pop("max_seq_len", max(seq)),
    )


def test_plan_expands_blocks_to_slots():
    step = _plan(PortableOps("cpu"), [6, 3], [1, 3], [[3, 5], [2, -1]], 4)
    assert step.slot_table.tolist() == [[12, 13, 14, 15, 20, 21], [8, 9, 10, 0, 0, 0]]
    assert step.slot_table.dtype == torch.int32
    assert step.q_start.tolist() == [5, 0] and step.token_req.tolist() == [0, 1, 1, 1]
    assert step.token_idx.tolist() == [0, 0, 1, 2]


def test_plan_width_is_the_host_bound_not_the_table():
    step = _plan(PortableOps("cpu"), [2], [2], [[1, 2, 3, 4]], 4, max_seq_len=5)
    assert step.slot_table.shape == (1, 5)  # max_seq_len columns, not 16


def test_plan_takes_numpy_integers():
    ops = PortableOps("cpu")
    step = ops.plan(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([[1]], dtype=torch.int32),
        np.int64(4),
        num_tokens=np.int32(2),
        max_query_len=np.int64(2),
        max_seq_len=np.int64(2),
    )
    assert step.num_tokens == 2 and step.slot_table.tolist() == [[4, 5]]


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(block_size=2.5), "block_size must be an integer"),
        (dict(block_size=True), "block_size must be an integer"),
        (dict(seq_lens=torch.tensor([2.0])), "seq_lens must be int32 or int64"),
        (dict(query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32)), "query_start_loc must be [2]"),
        (dict(block_table=torch.zeros(3, dtype=torch.int32)), "block_table must have 2 dimension(s)"),
        (dict(max_query_len=3), "max_query_len=3 exceeds max_seq_len=2"),
    ],
)
def test_plan_refuses_naming_the_argument(kw, needle):
    args = dict(
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        seq_lens=torch.tensor([2], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32),
        block_size=4,
    )
    host = dict(num_tokens=2, max_query_len=2, max_seq_len=2)
    for name in list(kw):
        (host if name in host else args)[name] = kw[name]
    with pytest.raises(OpsInputError) as info:
        PortableOps("cpu").plan(**args, **host)
    assert needle in str(info.value)


def test_flat_cache_layouts():
    separate = torch.zeros(5, 4, 2, 8)
    assert flat_cache(separate, "k").shape == (20, 2, 8)
    inter = torch.zeros(5, 4, 2, 16)[..., :8]  # the K half of an interleaved cache
    flat = flat_cache(inter, "k")
    assert flat.shape == (20, 2, 8) and flat.stride() == (32, 16, 1) and flat.data_ptr() == inter.data_ptr()
    head_major = torch.zeros(5, 2, 4, 8).transpose(1, 2)  # [N, P, H, D] seen over [N, H, P, D]
    with pytest.raises(OpsInputError, match="one slot stride"):
        flat_cache(head_major, "key_cache")
    with pytest.raises(OpsInputError, match="contiguous last dim"):
        flat_cache(torch.zeros(5, 8, 2).transpose(1, 2), "key_cache")


def test_store_skips_padding_and_refusals_write_nothing():
    ops = PortableOps("cpu")
    kv = torch.full((3, 4, 2, 16), float("nan"))
    kc, vc = kv[..., :8], kv[..., 8:]
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    ops.store_kv(k, v, kc, vc, torch.tensor([5, -1, 11, 12]))  # 12 is past the 12 slots
    flat_k = kc.flatten(0, 1)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[11], k[2])
    assert torch.equal(kv.flatten(0, 1)[11, :, 8:], v[2])
    untouched = [s for s in range(12) if s not in (5, 11)]
    assert bool(flat_k[untouched].isnan().all())
    before = kv.clone()
    for bad in (
        lambda: ops.store_kv(k.half(), v.half(), kc, vc, torch.tensor([1, 2, 3, 4])),
        lambda: ops.store_kv(k[:2], v[:2], kc, vc, torch.tensor([1, 2, 3, 4])),
        lambda: ops.store_kv(k, v, kc, vc, torch.tensor([1.0, 2.0, 3.0, 4.0])),
        lambda: ops.store_kv(k, v, kc, vc[:1], torch.tensor([1, 2, 3, 4])),
    ):
        with pytest.raises(OpsInputError):
            bad()
        assert torch.equal(kv.isnan(), before.isnan()) and torch.equal(kv.nan_to_num(), before.nan_to_num())


def test_attend_refusals_name_the_argument():
    ops = PortableOps("cpu")
    kc = vc = torch.zeros(2, 4, 2, 8)
    step = _plan(ops, [3], [3], [[1]], 4)
    q = torch.zeros(3, 4, 8)
    cases = {
        "query has 4 rows": dict(query=torch.zeros(4, 4, 8)),
        "must be a multiple": dict(query=torch.zeros(3, 3, 8)),
        "scale must be a finite float > 0": dict(scale=float("nan")),
        "window must be None or an int >= 1": dict(window=1.5),
        "softcap must be None": dict(softcap=0.0),
        "sinks must be float32 [4]": dict(sinks=torch.zeros(4, dtype=torch.float16)),
        "out must be like query": dict(out=torch.zeros(3, 4, 4)),
        "step must be the PagedStep": dict(step="step"),
    }
    for needle, bad in cases.items():
        args = {**dict(query=q, key_cache=kc, value_cache=vc, step=step, scale=0.5), **bad}
        with pytest.raises(OpsInputError) as info:
            ops.attend(args.pop("query"), args.pop("key_cache"), args.pop("value_cache"), args.pop("step"), **args)
        assert needle in str(info.value), (needle, str(info.value))


def test_pool_backend_and_ops_share_one_copy_of_the_math(monkeypatch):
    """PortableBackend.forward and PortableOps.attend both run attend_gathered."""
    from attnplug.backends import portable as backend_portable

    calls = []
    real = ops_portable.attend_gathered

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ops_portable, "attend_gathered", counting)
    monkeypatch.setattr(backend_portable, "attend_gathered", counting)
    ops = ReferenceBackend.paged_ops("cpu")
    kc = vc = torch.randn(2, 4, 2, 8)
    ops.attend(torch.randn(3, 4, 8), kc, vc, _plan(ops, [3], [3], [[1]], 4), scale=0.5)
    assert calls == [1]
    from attnplug import ForwardMode
    from attnplug_conformance.harness import World
    from worlds import small_spec

    world = World(small_spec(), ReferenceBackend, "cpu", seed=1)
    step = world.plan(ForwardMode.EXTEND, [world.new_request()], [4])
    world.run_eager(step)
    assert len(calls) > 1


def test_every_backend_names_its_ops():
    assert isinstance(ReferenceBackend.paged_ops("cpu"), PortableOps)
    assert ReferenceBackend.paged_ops("cpu").name == "reference"
    assert issubclass(ReferenceBackend, PortableBackend)
