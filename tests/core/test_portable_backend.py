"""The portable base, the graph buffers that keep rule 1 in graph mode, the device part, and
describe() derived from the declared capabilities."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug import ForwardMode, ReqToTokenPool, SWAKVPool
from attnplug.backend import GRAPH_MODES, AttentionBackend, Capabilities, GraphSupport
from attnplug.backends.portable import PortableBackend
from attnplug.backends.reference import ReferenceBackend
from attnplug.device_part import DevicePart
from attnplug.graph_buffers import GraphBuffers
from attnplug.graphs import EagerGraph, GraphRunner

CPU = torch.device("cpu")


def _pool():
    pool = SWAKVPool(64, 32, 2, [0], 2, 16, torch.float32, CPU)
    return pool, ReqToTokenPool(4, 32, CPU)


# ---------------------------------------------------------------------------- GraphBuffers: rule 1
def test_swa_buffer_is_allocated_once_filled_head_and_zeroed_tail():
    b = GraphBuffers(CPU, max_bs=4, max_num_tokens=8)
    buf = b.swa_out_cache_loc
    assert buf.dtype == torch.int32 and buf.shape == (8,) and not buf.any()
    b.fill_swa_out_cache_loc(torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int64))
    b.fill_swa_out_cache_loc(torch.tensor([3, -1, 0]))  # a shorter step after a longer one
    assert b.swa_out_cache_loc is buf  # same tensor: a captured graph keeps reading it
    assert buf.tolist() == [3, -1, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="max_num_tokens=8"):
        b.fill_swa_out_cache_loc(torch.zeros(9, dtype=torch.int32))


def test_views_share_storage_and_sizes_are_checked():
    b = GraphBuffers(CPU, max_bs=4, max_num_tokens=8)
    b.add("seq_lens", "requests")
    b.add("token_pos", "tokens", dtype=torch.int32)
    b.add("table", "requests", 5)
    b.add("cu", 5, dtype=torch.int32)
    for name, shape in (
        ("seq_lens", (3,)),
        ("token_pos", (6,)),
        ("table", (3, 5)),
        ("cu", (5,)),
        ("swa_out_cache_loc", (6,)),
    ):
        view = b.view(name, 3, 2)
        assert tuple(view.shape) == shape and view.data_ptr() == b[name].data_ptr(), name
    with pytest.raises(ValueError, match="5 requests / 10 tokens exceeds"):
        b.view("seq_lens", 5, 2)
    with pytest.raises(ValueError, match="already exists"):
        b.add("seq_lens", "requests")
    with pytest.raises(ValueError, match="rows must be"):
        b.add("x", "pages")
    with pytest.raises(ValueError, match="max_bs must be an int >= 1, got 0"):
        GraphBuffers(CPU, 0, 8)


def test_expected_buffer_is_the_pools_translation_padded_with_zeros():
    pool, _ = _pool()
    full = torch.tensor([3, 4, 5], dtype=torch.int64)
    pool.full_to_swa_index_mapping[full] = torch.tensor([7, 8, 9], dtype=pool.full_to_swa_index_mapping.dtype)
    loc = torch.tensor([3, 5, -1, 0, 10_000])
    want = pool.translate_loc_from_full_to_swa(loc).tolist() + [0, 0, 0]
    assert GraphBuffers.expected_swa_out_cache_loc(pool, loc, 8).tolist() == want
    assert want[:5] == [7, 9, -1, 0, -1]


def test_portable_backend_fills_its_graph_buffer_through_graph_buffers(monkeypatch):
    """The portable path's replay writes cuda_graph_swa_out_cache_loc only through
    GraphBuffers.fill_swa_out_cache_loc (the rule's one place)."""
    from attnplug import ForwardBatch, SWATokenAllocator

    pool, rows = _pool()
    backend = ReferenceBackend(pool, rows, num_heads=2, sliding_window=4)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert isinstance(backend.graph_buffers, GraphBuffers)
    assert backend.cuda_graph_swa_out_cache_loc is backend.graph_buffers.swa_out_cache_loc
    backend.cuda_graph_swa_out_cache_loc.fill_(99)  # a dirty tail from an earlier, larger step
    alloc = SWATokenAllocator(pool)
    r = rows.alloc()
    loc = alloc.alloc(3)
    rows.req_to_token[r, :3] = loc.int()
    calls = []
    real = GraphBuffers.fill_swa_out_cache_loc
    monkeypatch.setattr(GraphBuffers, "fill_swa_out_cache_loc", lambda self, t: calls.append(1) or real(self, t))
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=1,
        req_pool_indices=torch.tensor([r]),
        seq_lens=torch.tensor([3]),
        out_cache_loc=loc[2:],
        seq_lens_cpu=None,
    )
    backend.init_forward_metadata_replay_cuda_graph(batch)
    assert calls == [1]
    want = GraphBuffers.expected_swa_out_cache_loc(pool, loc[2:], 4)
    assert torch.equal(backend.cuda_graph_swa_out_cache_loc, want) and want[0] > 0


# ---------------------------------------------------------------------------- the portable base
def test_reference_is_the_portable_base_under_its_name():
    assert issubclass(ReferenceBackend, PortableBackend) and ReferenceBackend.name == "reference"
    assert ReferenceBackend.device_part.device_type == "any"
    for method in ("_build_metadata", "_fill_graph_metadata", "_graph_views", "_store_kv", "_attend"):
        assert callable(getattr(ReferenceBackend, method)), method


class _Part(DevicePart):
    device_type = "any"

    def __init__(self, graphs=True):
        self.graphs, self.calls = graphs, []

    def new_graph(self):
        self.calls.append("new_graph")
        return EagerGraph()

    def graphs_available(self):
        return self.graphs

    def synchronize(self, device):
        self.calls.append("synchronize")

    def describe(self):
        return {"graph_class": "eager", "graphs": "ALWAYS"}  # may not override a flag


def test_device_services_delegate_to_the_device_part():
    part = _Part()

    class Mine(PortableBackend):
        name = "mine"
        device_part = part

    assert isinstance(Mine.new_graph(), EagerGraph)
    Mine.synchronize(CPU)
    assert part.calls == ["new_graph", "synchronize"]
    assert isinstance(AttentionBackend.new_graph(), EagerGraph)  # the core's default part


@pytest.mark.parametrize("graphs", [True, False])
def test_describe_is_derived_from_the_capabilities_and_never_disagrees(graphs):
    class Mine(PortableBackend):
        name = "mine"
        device_part = _Part(graphs)
        dtypes = (torch.float32,)

    pool, rows = _pool()
    caps = Mine(pool, rows, num_heads=2, sliding_window=4).capabilities()
    facts = Mine.describe()
    assert facts["graph_class"] == "eager"  # the device part's facts are added ...
    assert facts["graphs"] == caps.graphs.name  # ... never over a flag
    assert caps.graphs is (GraphSupport.ALWAYS if graphs else GraphSupport.NEVER)
    assert Mine.declared_capabilities().graphs is GraphSupport.ALWAYS  # the install-independent claim
    json_caps = caps.to_json()
    for key in ("needs_cpu_seq_lens", "pdl", "graphs", "dtypes", "head_dims", "page_sizes", "sliding_window"):
        assert facts[key] == json_caps[key], key
    assert caps.device_type == "cpu" and facts["device_type"] == "any"


def test_an_instance_cannot_claim_more_than_its_class_declares():
    declared = ReferenceBackend.declared_capabilities()
    with pytest.raises(ValueError, match="pdl=True"):
        declared.for_instance(device_type="cpu", pdl=True)
    uniform = dataclasses.replace(declared, graphs=GraphSupport.UNIFORM)
    with pytest.raises(ValueError, match="ALWAYS is above the declared UNIFORM"):
        uniform.for_instance(device_type="cpu", graphs=GraphSupport.ALWAYS)
    assert declared.for_instance(device_type="cpu", graphs=GraphSupport.NEVER).graphs is GraphSupport.NEVER


def test_describe_shows_run_time_pdl_for_a_backend_that_declares_it():
    class Fast(ReferenceBackend):
        @classmethod
        def declared_capabilities(cls):
            return Capabilities(**{**super().declared_capabilities().__dict__, "pdl": True})

    assert Fast.describe()["pdl"] == "run time"
    assert ReferenceBackend.describe()["pdl"] is False


# ---------------------------------------------------------------------------- GraphSupport -> modes
def test_graph_modes_table_and_always_includes_extend():
    assert GraphSupport.NEVER.modes == ()
    assert GraphSupport.DECODE_ONLY.modes == (ForwardMode.DECODE,)
    assert set(GraphSupport.UNIFORM.modes) == {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
    assert set(GraphSupport.ALWAYS.modes) == set(GraphSupport.UNIFORM.modes) | {ForwardMode.EXTEND}
    assert all(set(GRAPH_MODES[a]) <= set(GRAPH_MODES[b]) for a, b in zip(GraphSupport, list(GraphSupport)[1:]))


def test_runner_over_an_always_backend_says_why_extend_runs_eagerly():
    pool, rows = _pool()
    backend = ReferenceBackend(pool, rows, num_heads=2, sliding_window=4)
    assert backend.capabilities().graphs is GraphSupport.ALWAYS
    runner = GraphRunner(
        backend, lambda batch, inputs: inputs["x"], max_bs=2, inputs={"x": ((4,), torch.float32)}, num_draft_tokens=2
    )
    assert set(runner.modes) == set(GraphSupport.UNIFORM.modes)
    assert "built without extend_tokens" in runner.not_captured[ForwardMode.EXTEND]
