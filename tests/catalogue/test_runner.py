"""Catalogue of adversarial cases for ``GraphRunner`` (issue 37, Trust II: the graph runner).

What it covers, each case either a clear refusal that names the argument or field and its
value, with every piece of state bit-identical afterwards (the runner's static buffers, the
backend's graph buffers, the KV pool, the allocator and the request table:
``memory_snapshot``), or a result checked against the eager path:

* construction arguments the runner used to coerce, sort, deduplicate or drop (draft counts,
  bucket lists, modes, input declarations, the backend and the step themselves), refused before
  the backend's ``init_cuda_graph_state`` runs;
* replay inputs that do not fit the captured buffers: fewer rows, an extra dimension, another
  dtype or device, a missing or undeclared input, a part of the runner's own static buffers,
  batch fields of the wrong length, dtype or device, a batch that is not one;
* ``positions=None``: refused whether the step would replay, run eagerly (too large) or trigger
  the first capture, so replay and eager agree; and a step that reads its positions gets each
  step's own positions in replay;
* steps no graph covers (a batch size between buckets, larger than ``max_bs``, another
  ``num_draft_tokens``, a mode not captured) give the eager result;
* a second runner on the same backend: replayed with ``TapeGraph`` (tests/fake_graph_device.py),
  a stand-in that replays the tape of its capture over the captured tensors like a device graph
  (the core's eager stand-in re-runs the Python step and hides a runner whose graphs read
  abandoned buffers); for the reference and the cuda backend (Triton interpreter), and a
  backend with one graph state, which refuses the second runner while the first lives;
* replay misuse: ``replay()`` with nothing prepared, after a refused ``prepare``, or after
  another runner of the backend prepared in between.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
from types import SimpleNamespace

import pytest
import torch

from attnplug import ForwardMode, GraphRunner
from attnplug.backend import AttentionBackend
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.harness import World
from fake_graph_device import use_tape_graphs
from memory_snapshot import assert_same, snapshot
from oracle import assert_close_rel
from worlds import kernel_spec, tiny_spec

SPEC = tiny_spec(sliding_window=6, max_reqs=10, max_context_len=48)
D, TV, DX = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND
NDT = 2


def _world(n_reqs=4, cls=ReferenceBackend, spec=SPEC, seed=4, device="cpu"):
    world = World(spec, cls, device, seed=seed)
    return world, world.prefill([3 + 2 * i for i in range(n_reqs)])


def _runner(world, *, tape=False, **kw):
    if tape:
        use_tape_graphs(world.backend)
    args = dict(max_bs=4, bucket_sizes=[2, 4], num_draft_tokens=NDT, modes=[D, TV])
    args.update(kw)
    return world.graph_runner(**args)


def _state(world, runner=None):
    """Everything a refused call must leave as it was (``memory_snapshot`` walks objects,
    lists and tensors: dicts of tensors are given as lists)."""
    parts = [world.pool, world.alloc, world.rows]
    gb = getattr(world.backend, "graph_buffers", None)
    if gb is not None:
        tensors = [gb.swa_out_cache_loc] + [t for _, (_, t) in sorted(gb._buffers.items())]
        tensors += [t for _, t in sorted(getattr(gb, "shared", {}).items())]
        parts.append(SimpleNamespace(graph_buffers=tensors, views=sorted(map(str, getattr(gb, "views", {})))))
    if runner is not None:
        parts.append(
            SimpleNamespace(
                buffers=[runner.req_pool_indices, runner.seq_lens, runner.out_cache_loc, runner.positions],
                inputs=[runner.inputs[k] for k in sorted(runner.inputs)],
                padding=[runner._dirty_requests, runner._dirty_tokens, runner._dirty_positions],
                capture_ran=runner.capture_ran,
                graphs=sorted(f"{m.name}/{b}" for m, b in runner.graphs),
                prepared=runner._prepared is None,
            )
        )
    return snapshot(*parts)


def _replayed(world, runner, reqs, mode=D):
    """One step replayed and committed: the static buffers hold a real step's values."""
    step = world.plan(mode, reqs, num_draft_tokens=NDT if mode.is_speculative else None)
    assert runner.bucket_for(step.batch) is not None
    out = runner.run(step.batch, step.inputs).clone()
    world.advance(step)
    return out


def _matches_eager(world, runner, step, what, step_fn=None, tol=1e-6):
    out = runner.run(step.batch, step.inputs).clone()
    if step_fn is None:
        eager = world.run_eager(step)  # rewrites the same k/v at the same slots
    else:
        world.backend.init_forward_metadata(step.batch)
        eager = step_fn(step.batch, step.inputs)
    assert_close_rel(out, eager.double().cpu(), tol, what)
    world.advance(step)


# ---------------------------------------------------------------- construction
def _shapes():
    return {"q": ((2, 4, 16), torch.float32)}


_NOT_A_SEQUENCE = ForwardMode.DECODE  # a single mode where a sequence is expected

BAD_ARGS = [
    ("max-bs-zero", dict(max_bs=0), "max_bs must be a positive int, got 0"),
    ("max-bs-negative", dict(max_bs=-3), "max_bs must be a positive int, got -3"),
    ("max-bs-bool", dict(max_bs=True), "max_bs must be an int, got the bool True"),
    ("draft-count-zero", dict(num_draft_tokens=0), "num_draft_tokens must be a positive int, got 0"),
    ("buckets-empty", dict(bucket_sizes=[]), "bucket_sizes must list at least one batch size, got []"),
    (
        "buckets-unsorted",
        dict(bucket_sizes=[4, 2]),
        "bucket_sizes must be strictly increasing (no repeats), got [4, 2]",
    ),
    ("buckets-repeated", dict(bucket_sizes=[2, 2, 4]), "strictly increasing (no repeats), got [2, 2, 4]"),
    ("bucket-over-max-bs", dict(bucket_sizes=[1, 8]), "bucket_sizes must lie in 1..max_bs=4, got [1, 8]"),
    ("buckets-an-int", dict(bucket_sizes=4), "bucket_sizes must be a sequence of ints, got 4"),
    ("bucket-float", dict(bucket_sizes=[1.0, 2]), "bucket_sizes entry must be an int, got 1.0"),
    ("modes-empty", dict(modes=[]), "modes must name at least one mode to capture, got []"),
    ("modes-repeated", dict(modes=[D, D]), "modes must not repeat a mode, got ['DECODE', 'DECODE']"),
    ("mode-a-string", dict(modes=["DECODE"]), "modes entries must be ForwardMode values, got 'DECODE'"),
    ("modes-one-mode", dict(modes=_NOT_A_SEQUENCE), "modes must be a sequence of ForwardMode, got <ForwardMode.DECODE"),
    ("mode-extend", dict(modes=[ForwardMode.EXTEND]), "mode EXTEND needs extend_tokens"),
    ("mode-idle", dict(modes=[ForwardMode.IDLE]), "cannot capture ['IDLE']"),
    ("verify-without-drafts", dict(modes=[D, TV]), "modes ['TARGET_VERIFY'] need num_draft_tokens"),
    (
        "input-shape-an-int",
        dict(inputs={"q": (16, torch.float32)}),
        "inputs['q'] shape must be a sequence of ints, got 16",
    ),
    (
        "input-dim-zero",
        dict(inputs={"q": ((4, 0), torch.float32)}),
        "inputs['q'] shape entry must be a positive int, got 0",
    ),
    (
        "input-dtype-a-string",
        dict(inputs={"q": ((4,), "float32")}),
        "inputs['q'] dtype must be a torch.dtype, got 'float32'",
    ),
    ("inputs-a-list", dict(inputs=[("q", ((4,), torch.float32))]), "inputs must map each input's name"),
    ("step-none", dict(step=None), "step must be callable as step(batch, inputs), got None"),
]


@pytest.mark.parametrize("kw, needle", [c[1:] for c in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_construction_refuses_bad_arguments_and_changes_nothing(kw, needle):
    world, _ = _world(n_reqs=1)
    args = dict(step=world.step_fn, max_bs=4, inputs=_shapes())
    args.update(kw)
    before = _state(world)
    with pytest.raises(ValueError, match=re.escape(needle)):
        GraphRunner(world.backend, **args)
    assert_same(before, _state(world))
    assert world.backend.graph_buffers is None, "a refused runner ran init_cuda_graph_state"


def test_construction_refuses_what_is_not_a_backend():
    with pytest.raises(ValueError, match=re.escape("backend must be an AttentionBackend, got object")):
        GraphRunner(object(), lambda b, i: i["q"], max_bs=2, inputs=_shapes())


# ---------------------------------------------------------------- replay inputs that do not fit
def _shift(runner, step):
    n = step.batch.num_tokens
    return {**step.inputs, "q": runner.inputs["q"][1 : n + 1]}


BAD_INPUTS = [
    ("fewer-rows", lambda r, s: {**s.inputs, "q": s.inputs["q"][:1]}, "inputs['q'] is (1, 2, 4, 16); the captured"),
    ("extra-dim", lambda r, s: {**s.inputs, "q": s.inputs["q"][:, None]}, "inputs['q'] is (3, 1, 2, 4, 16)"),
    ("float64", lambda r, s: {**s.inputs, "q": s.inputs["q"].double()}, "inputs['q'] is torch.float64 on cpu"),
    ("meta-device", lambda r, s: {**s.inputs, "q": s.inputs["q"].to("meta")}, "inputs['q'] is torch.float32 on meta"),
    ("missing", lambda r, s: {"q": s.inputs["q"], "v": s.inputs["v"]}, "inputs['k'] must be a tensor"),
    ("undeclared", lambda r, s: {**s.inputs, "bias": s.inputs["q"]}, "inputs['bias'] is not an input of this runner"),
    ("static-part", _shift, "inputs['q'] is another part of the runner's static buffers"),
    ("a-list", lambda r, s: list(s.inputs.values()), "inputs must map each input's name to a tensor, got list"),
]


@pytest.mark.parametrize("change, needle", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_inputs_that_do_not_fit_are_refused_and_change_nothing(change, needle):
    world, reqs = _world()
    runner = _runner(world)
    _replayed(world, runner, reqs)
    step = world.plan(D, reqs[:3])
    inputs = change(runner, step)
    before = _state(world, runner)
    with pytest.raises(ValueError, match=re.escape(needle)):
        runner.run(step.batch, inputs)
    assert_same(before, _state(world, runner))


def _loose(batch, **fields):
    """A copy of ``batch`` with ``fields`` set after construction, unvalidated (what an engine
    that builds batches with ``validate=False``, or edits one, can hand over)."""
    loose = dataclasses.replace(batch, validate=False)
    for name, value in fields.items():
        setattr(loose, name, value)
    return loose


BAD_BATCHES = [
    ("seq-lens-short", lambda b: _loose(b, seq_lens=b.seq_lens[:1]), "batch.seq_lens is (1,) torch.int64 on cpu; the"),
    (
        "rows-float",
        lambda b: _loose(b, req_pool_indices=b.req_pool_indices.float()),
        "batch.req_pool_indices is torch.float32 on cpu",
    ),
    (
        "slots-meta",
        lambda b: _loose(b, out_cache_loc=b.out_cache_loc.to("meta")),
        "batch.out_cache_loc is torch.int64 on meta",
    ),
    ("positions-int32", lambda b: _loose(b, positions=b.positions.int()), "batch.positions is torch.int32 on cpu"),
    (
        "tokens-not-bs-x-q",
        lambda b: _loose(b, out_cache_loc=b.out_cache_loc[:2], positions=b.positions[:2]),
        "batch.out_cache_loc has 2 tokens; a DECODE batch of 3 requests has 3 x 1",
    ),
    (
        "batch-size-negative",
        lambda b: _loose(b, batch_size=-1),
        "batch.batch_size must be an int >= 1 in DECODE mode, got -1",
    ),
    (
        "mode-a-string",
        lambda b: _loose(b, forward_mode="decode"),
        "batch.forward_mode must be a ForwardMode, got 'decode'",
    ),
    ("not-a-batch", lambda b: dataclasses.asdict(b), "batch must be a ForwardBatch, got dict"),
]


@pytest.mark.parametrize("change, needle", [c[1:] for c in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
def test_batches_that_do_not_fit_are_refused_and_change_nothing(change, needle):
    world, reqs = _world()
    runner = _runner(world)
    _replayed(world, runner, reqs)
    step = world.plan(D, reqs[:3])
    batch = change(step.batch)
    before = _state(world, runner)
    with pytest.raises(ValueError, match=re.escape(needle)):
        runner.run(batch, step.inputs)
    assert_same(before, _state(world, runner))


class _NeedsCpu(ReferenceBackend):
    needs_cpu_seq_lens = True


def test_a_missing_host_mirror_is_refused_before_anything_is_copied():
    world, reqs = _world(cls=_NeedsCpu)
    runner = _runner(world)
    _replayed(world, runner, reqs)
    step = world.plan(D, reqs[:3])
    batch = dataclasses.replace(step.batch, seq_lens_cpu=None)
    before = _state(world, runner)
    with pytest.raises(ValueError, match=re.escape("seq_lens_cpu")):
        runner.run(batch, step.inputs)
    assert_same(before, _state(world, runner))


# ---------------------------------------------------------------- positions=None
@pytest.mark.parametrize(
    "path, mode, n_reqs",
    [("replay", D, 3), ("replay", TV, 2), ("eager-too-large", D, 6), ("first-capture", D, 3)],
    ids=["replay-decode", "replay-verify", "eager-too-large", "first-capture"],
)
def test_a_step_without_positions_is_refused_on_every_path(path, mode, n_reqs):
    """It replayed the previous step's positions; an eager step saw None. Now both refuse."""
    world, reqs = _world(n_reqs=6)
    runner = _runner(world, capture=path != "first-capture")
    if path != "first-capture":
        _replayed(world, runner, reqs[:4], mode)
    step = world.plan(mode, reqs[:n_reqs], num_draft_tokens=NDT if mode.is_speculative else None)
    assert (runner.why_eager(step.batch) is None) == (path == "replay")
    batch = dataclasses.replace(step.batch, positions=None)
    before = _state(world, runner)
    with pytest.raises(ValueError, match=re.escape(f"batch.positions is None: a {mode.name} step must give")):
        runner.run(batch, step.inputs)
    with pytest.raises(ValueError, match=re.escape("batch.positions is None")):
        runner.prepare(batch, step.inputs)
    assert_same(before, _state(world, runner))
    with pytest.raises(RuntimeError, match="prepare"):
        runner.replay()  # the refused step left nothing prepared


def test_a_step_that_reads_its_positions_gets_each_steps_own_in_replay():
    world, reqs = _world()

    def step_fn(batch, inputs):
        out = world.step_fn(batch, inputs)
        return out + batch.positions.to(out.dtype)[:, None, None, None]

    use_tape_graphs(world.backend)
    runner = GraphRunner(world.backend, step_fn, max_bs=4, inputs=world.input_shapes(), bucket_sizes=[2, 4])
    for k in (4, 3, 3):
        _matches_eager(world, runner, world.plan(D, reqs[:k]), f"positions of a {k}-request step", step_fn)


# ---------------------------------------------------------------- steps no graph covers
@pytest.mark.parametrize(
    "what, mode, n_reqs, ndt, bucket",
    [
        ("between-buckets", D, 3, None, 4),
        ("smaller-than-every-bucket", D, 1, None, 2),
        ("larger-than-max-bs", D, 6, None, None),
        ("other-draft-count", TV, 2, 3, None),
        ("mode-not-captured", DX, 2, NDT, None),
    ],
)
def test_a_step_no_bucket_fits_exactly_gives_the_eager_result(what, mode, n_reqs, ndt, bucket):
    world, reqs = _world(n_reqs=6)
    runner = _runner(world, tape=True)
    step = world.plan(mode, reqs[:n_reqs], num_draft_tokens=ndt)
    assert runner.bucket_for(step.batch) == bucket
    assert (runner.why_eager(step.batch) is None) == (bucket is not None)
    _matches_eager(world, runner, step, what)


def test_inputs_with_more_rows_and_int32_request_fields_give_the_eager_result():
    world, reqs = _world()
    runner = _runner(world, tape=True)
    step = world.plan(D, reqs[:3])
    b = step.batch
    batch = dataclasses.replace(b, req_pool_indices=b.req_pool_indices.int(), seq_lens=b.seq_lens.int())
    longer = {k: torch.cat([x, torch.full_like(x[:2], float("nan"))]) for k, x in step.inputs.items()}
    out = runner.run(batch, longer).clone()
    assert_close_rel(out, world.run_eager(step).double(), 1e-6, "extra input rows, int32 request fields")


# ---------------------------------------------------------------- a second runner on the backend
def test_a_second_runner_leaves_the_first_runners_graphs_their_buffers():
    """Replayed like a device graph, the first runner's graphs read the buffers they were
    captured with; its replay metadata must fill those, not the second runner's."""
    world, reqs = _world(n_reqs=6)
    first = _runner(world, tape=True)
    _matches_eager(world, first, world.plan(D, reqs[:3]), "first runner alone")
    second = _runner(world, tape=True, max_bs=4, bucket_sizes=[4])
    _matches_eager(world, second, world.plan(D, reqs[:4]), "second runner")
    _matches_eager(world, first, world.plan(D, reqs[:3]), "first runner after the second was built")
    _matches_eager(world, first, world.plan(TV, reqs[:2], num_draft_tokens=NDT), "first runner, verify")
    _matches_eager(world, second, world.plan(D, reqs[:4]), "second runner again")


def test_a_smaller_second_runner_does_not_break_the_first():
    world, reqs = _world(n_reqs=6)
    first = _runner(world, tape=True)
    _runner(world, tape=True, max_bs=1, bucket_sizes=[1], modes=[D], num_draft_tokens=None)
    _matches_eager(world, first, world.plan(D, reqs[:4]), "first runner after a smaller second")


def test_replay_after_another_runner_prepared_is_refused():
    world, reqs = _world(n_reqs=6)
    first, second = _runner(world, tape=True), _runner(world, tape=True)
    step = world.plan(D, reqs[:3])
    assert first.prepare(step.batch, step.inputs)
    other = world.plan(D, reqs[3:5])
    assert second.prepare(other.batch, other.inputs)
    with pytest.raises(RuntimeError, match="another GraphRunner of backend 'reference' prepared a step"):
        first.replay()
    assert_close_rel(second.replay().clone(), world.run_eager(other).double(), 1e-6, "second runner")
    world.advance(other)
    _matches_eager(world, first, step, "first runner, prepared again")


_DEFAULT_GET = getattr(AttentionBackend, "get_cuda_graph_state", None)
_DEFAULT_SET = getattr(AttentionBackend, "set_cuda_graph_state", None)


class _OneState(ReferenceBackend):
    """A backend with one graph state (the contract's default hooks)."""

    if _DEFAULT_GET is not None:
        get_cuda_graph_state = _DEFAULT_GET
        set_cuda_graph_state = _DEFAULT_SET


def test_a_backend_with_one_graph_state_refuses_a_second_live_runner():
    world, reqs = _world(cls=_OneState)
    first = _runner(world, tape=True)
    before = _state(world, first)
    with pytest.raises(ValueError, match="backend 'reference' .* already has a live GraphRunner"):
        _runner(world, tape=True)
    assert_same(before, _state(world, first))
    _matches_eager(world, first, world.plan(D, reqs[:3]), "the first runner, still the backend's")
    del first
    gc.collect()
    second = _runner(world, tape=True)  # the first is gone: its buffers may be replaced
    _matches_eager(world, second, world.plan(D, reqs[:3]), "a runner built after the first was dropped")


def test_a_foreign_graph_state_is_refused():
    world, _ = _world(n_reqs=1)
    _runner(world, capture=False)
    with pytest.raises(TypeError, match="state must be the GraphBuffers of a reference backend"):
        world.backend.set_cuda_graph_state({"swa_out_cache_loc": torch.zeros(4, dtype=torch.int32)})


# ---------------------------------------------------------------- the cuda backend
GPU = torch.cuda.is_available()


def _cuda_world():
    """A cuda-backend world: on a GPU (its graphs are CUDA graphs), else in the Triton
    interpreter (its graphs there: ``TapeGraph``, which records the interpreter's launches)."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not GPU:
        pytest.skip("needs the Triton interpreter (set by conftest without a GPU) or a GPU")
    pytest.importorskip("triton")
    from attnplug_cuda.backend import CudaBackend

    return _world(cls=CudaBackend, spec=kernel_spec(max_reqs=8), seed=6, device="cuda" if GPU else "cpu")


def test_cuda_a_larger_second_runner_leaves_the_first_its_buffers():
    world, reqs = _cuda_world()
    first = _runner(world, tape=not GPU, bucket_sizes=[4], modes=[D], num_draft_tokens=None)
    second = _runner(world, tape=not GPU, max_bs=12, bucket_sizes=[12], modes=[D], num_draft_tokens=None)
    assert second.max_bs > world.rows.req_to_token.shape[0]  # the backend grows its request tables
    # float16 kernels: a padded bucket may split the work otherwise than the eager step
    _matches_eager(world, first, world.plan(D, reqs[:3]), "cuda: first runner after a larger second", tol=2e-3)


def test_cuda_a_step_without_positions_is_refused_before_the_one_launch_copies_it():
    world, reqs = _cuda_world()
    runner = _runner(world, bucket_sizes=[4], modes=[D], num_draft_tokens=None)
    assert runner.backend_copies_batch
    _replayed(world, runner, reqs)
    step = world.plan(D, reqs[:3])
    before = _state(world, runner)
    with pytest.raises(ValueError, match=re.escape("batch.positions is None")):
        runner.run(dataclasses.replace(step.batch, positions=None), step.inputs)
    assert_same(before, _state(world, runner))


# ---------------------------------------------------------------- replay misuse
def test_replay_with_nothing_prepared_and_after_a_refused_prepare():
    world, reqs = _world()
    runner = _runner(world)
    with pytest.raises(RuntimeError, match="replay\\(\\) needs a step prepared by prepare"):
        runner.replay()
    step = world.plan(D, reqs[:3])
    assert runner.prepare(step.batch, step.inputs)
    with pytest.raises(ValueError, match="inputs\\['q'\\]"):
        runner.prepare(step.batch, {**step.inputs, "q": step.inputs["q"].double()})
    with pytest.raises(RuntimeError, match="replay\\(\\) needs a step prepared by prepare"):
        runner.replay()  # the refused preparation replaced the earlier one with nothing
