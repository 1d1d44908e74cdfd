"""The conformance suite against its mutant catalogue: the deliberately broken backends of
``tests/broken_backends.py`` and the subtle kernel bugs of ``tests/mutants/`` (a package).

For every mutant two things are shown:

1. it is really wrong, by a direct demonstration independent of the suite (its ``WITNESS``:
   twin worlds compared with float64 attention, the KV cache, the output dtype, an ATen-op
   counter around replay metadata, or the mapping rewritten under the layers);
2. the WHOLE suite, run in-process with ``-x`` (stop at the first failure; the suite runs its
   cheap checks first), fails it with a message that names a rule, and does so within the
   tests that ``--attnplug-quick`` selects (the first round and every declared shape).

The control mutant (``NoOpMutant``: the reference backend with a no-op override) passes the
whole suite, skipping only what the reference's capabilities leave out. The mutation score
(mutants caught / mutants) must be 100 %.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mutants
import suite_runs
from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.exact import dense_attention
from attnplug_conformance.harness import World, WorldSpec
from attnplug_conformance.model_check import transformers_missing
from attnplug_conformance.plugin import check_names
from attnplug_conformance.rules import ALL_RULES
from broken_backends import DirtyTailDeclared
from worlds import small_spec

pytestmark = pytest.mark.slow  # each case runs the conformance suite on a mutant

#: broken_backends classes that must fail the suite (HonestPdl is correct; DirtyTailDeclared
#: declares its failure and is reported as a strict xfail)
BROKEN = [
    "TranslatePerLayer",
    "GatherPerLayer",
    "RenamedBuffer",
    "DirtyTail",
    "ReferenceDeclaresBogusXfail",
    "ItemInReplay",
    "TensorFromListInReplay",
    "WindowOffByOne",
    "WrongSlot",
    "ReallocatingReplay",
    "PdlChangesResults",
    "PdlIgnoresEnv",
    "NeedsSeqLensCpu",
    "ReplayDiffers",
]
SUBTLE = [cls.__name__ for cls in mutants.SUBTLE]
CATALOGUE = [("broken_backends", n) for n in BROKEN] + [("mutants", n) for n in SUBTLE]


def suite_x(target: str):
    """The whole suite against ``target`` with ``-x``: ``(first failure or None, results, seconds)``."""
    results, elapsed = suite_runs.run_suite(target, "", True)
    failed = [r for r in results.values() if r.outcome in ("failed", "error", "xpassed")]
    return (failed[0] if failed else None), results, elapsed


# ---------------------------------------------------------------------------- the suite catches each
@pytest.mark.parametrize("module,name", CATALOGUE, ids=[n for _, n in CATALOGUE])
def test_suite_fails_mutant_naming_the_rule(module, name):
    first, results, elapsed = suite_x(f"{module}:{name}")
    assert first is not None, f"the suite passed {name} ({len(results)} tests run in {elapsed:.0f} s)"
    names_rule = first.message.startswith(ALL_RULES) or any(rule in first.message for rule in ALL_RULES)
    # a declared expected failure that does not fail: the message names the declaration instead
    names_declaration = "XPASS(strict)" in first.message and "conformance_xfail" in first.message
    assert names_rule or names_declaration, f"{name}: failure in {first.check} names no rule: {first.message!r}"
    # the run order puts a cheap case of every bug class first: each is caught within the
    # quick profile (the first round and every declared shape), which keeps -x runs short
    position = list(results).index(first.nodeid)
    assert position < suite_runs.quick_profile_size(), (
        f"{name} is caught only by test {position + 1} of the run order ({first.nodeid}), after the quick profile"
    )


def test_control_mutant_passes_the_whole_suite():
    first, results, _ = suite_x("mutants:NoOpMutant")
    assert first is None, f"{first.nodeid}: {first.message}"
    assert {r.outcome for r in results.values()} <= {"passed", "skipped"}
    assert sum(r.outcome == "passed" for r in results.values()) > 50
    assert {r.check for r in results.values()} == set(check_names())
    # skipped only from the reference's capabilities, by name; the cross product of every
    # declared shape runs only in the thorough profile
    skipped = {r.check: r.message for r in results.values() if r.outcome == "skipped"}
    expected = {
        "check_pdl_on_off_identical": "capabilities().pdl is False: no PDL launches to compare",
        "check_attention_matches_reference": "runs with --attnplug-thorough (attnplug conformance --thorough)",
        "check_softcap_and_sinks": "the backend declares logit_softcap and attention_sinks: nothing to refuse",
        # its other case, past_2_31, is left out of whole-suite runs (suite_runs.LARGE_BUFFERS_CASE)
        "check_large_kv_buffers": "capabilities().large_kv_buffers is True: nothing to refuse "
        "(past_2_31 runs a buffer past 2**31 elements)",
    }
    if transformers_missing():  # the model-level check needs transformers
        expected["check_matches_transformers"] = transformers_missing()
    else:  # every architecture in float32 by default; the other dtypes in the thorough profile
        expected["check_matches_transformers"] = (
            "another dtype of an architecture the default run covers: runs with --attnplug-thorough"
        )
    assert skipped == expected


def test_declared_failure_is_still_detected():
    """A backend's declared failure (``conformance_xfail``) marks the check it names xfail
    (strict): the check still runs and fails, and the run of that check passes."""
    (check,) = DirtyTailDeclared.conformance_xfail
    results, _ = suite_runs.run_suite("broken_backends:DirtyTailDeclared", check)
    assert results and {r.check for r in results.values()} == {check}
    assert not [r for r in results.values() if r.outcome in ("failed", "error", "xpassed")]
    assert any(r.outcome == "xfailed" for r in results.values())


def test_catalogue_size_and_mutation_score():
    assert len(SUBTLE) >= 25 and len(BROKEN) >= 14
    caught = [n for m, n in CATALOGUE if suite_x(f"{m}:{n}")[0] is not None]
    score = len(caught) / len(CATALOGUE)
    assert score == 1.0, f"mutation score {score:.0%}: not caught: {sorted(set(n for _, n in CATALOGUE) - set(caught))}"


# ---------------------------------------------------------------------------- each mutant is really wrong
def _spec(**overrides) -> WorldSpec:
    return small_spec(**{"size_swa": 512, "max_reqs": 12, **overrides})


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    a = out.detach().to("cpu", torch.float64)
    return float(((a - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)).max())


def _output_witness(cls, overrides, plan) -> str:
    """Twin worlds (mutant, reference) run ``plan``; returns why the mutant is wrong, or ''."""
    spec = _spec(**overrides)
    worlds = [World(spec, c, "cpu", seed=3) for c in (cls, ReferenceBackend)]
    first = plan[0][1]
    reqs = [[w.new_request() for _ in first] for w in worlds]
    for mode_name, arg in plan:
        direct = mode_name == "EXTEND_DIRECT"
        mirror = mode_name.endswith("_MIRROR")
        mode = ForwardMode[mode_name.replace("_DIRECT", "").replace("_MIRROR", "")]
        outs, steps = [], []
        for w, rs in zip(worlds, reqs):
            step = w.plan(
                mode,
                rs,
                arg if mode is ForwardMode.EXTEND else None,
                num_draft_tokens=arg if mode.is_speculative else None,
                seq_lens_cpu=True if mirror else None,
            )
            steps.append(step)
            if direct:
                w.store_kv(step)
                continue
            try:
                outs.append(w.run_eager(step))
            except Exception as exc:  # on a GPU: a silent out-of-bounds access
                return f"{mode_name} raised {type(exc).__name__}: {exc}"
        if outs:
            exact = dense_attention(worlds[1], steps[1])
            bad, ref = _relative_error(outs[0], exact), _relative_error(outs[1], exact)
            if bad > 4 * ref + 1e-6:
                return f"{mode_name}: relative error {bad:.3g} against float64 (reference: {ref:.3g})"
        for layer in range(spec.num_layers):
            for a, b in zip(worlds[0].pool.get_kv_buffer(layer), worlds[1].pool.get_kv_buffer(layer)):
                if not torch.equal(a, b):
                    return f"{mode_name}: layer {layer} KV cache differs from the reference"
        for w, s in zip(worlds, steps):
            w.advance(s)
    return ""


class _AtenSyncCounter(TorchDispatchMode):
    """Minimal, independent of the suite's detector: ATen scalar reads and value-sized ops."""

    NAMES = {"_local_scalar_dense", "bincount", "nonzero", "_unique2", "masked_select"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in self.NAMES or (
            name == "repeat_interleave" and kwargs.get("output_size") is None and func._overloadname == "Tensor"
        ):
            self.seen.append(name)
        return func(*args, **kwargs)


def _sync_witness(cls) -> str:
    world = World(_spec(), cls, "cpu", seed=3)
    reqs = world.prefill([5, 9, 7], backend=world.reference_backend)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[4], modes=[ForwardMode.DECODE])
    counter = _AtenSyncCounter()
    original = world.backend.init_forward_metadata_replay_cuda_graph

    def counted(batch):
        with counter:
            return original(batch)

    world.backend.init_forward_metadata_replay_cuda_graph = counted
    step = world.plan(ForwardMode.DECODE, reqs)
    runner.run(step.batch, step.inputs)
    return f"replay metadata ran aten {sorted(set(counter.seen))}" if counter.seen else ""


def _mapping_witness(cls) -> str:
    """Rewrite the window prefix's mapping after metadata: the output must not change."""
    outs = []
    for poison in (False, True):
        world = World(_spec(sliding_window=6), cls, "cpu", seed=3)
        reqs = world.prefill([9, 12], backend=world.reference_backend)
        step = world.plan(ForwardMode.DECODE, reqs)
        world.backend.init_forward_metadata(step.batch)
        if poison:
            mapping = world.pool.full_to_swa_index_mapping
            prefix = torch.cat([world.rows.req_to_token[r.row, r.seq_len - 5 : r.seq_len] for r in reqs]).long()
            spare = torch.arange(400, 400 + prefix.numel())
            for layer in world.pool.swa_layer_ids:
                for buf in world.pool.get_kv_buffer(layer):
                    buf[spare] = torch.randn(buf[spare].shape)
            mapping[prefix] = spare.to(mapping.dtype)
        outs.append(world.step_fn(step.batch, step.inputs))
    diff = float((outs[0] - outs[1]).abs().max())
    return f"output changed by {diff:.3g} when the mapping changed after metadata" if diff > 0 else ""


def _dtype_witness(cls) -> str:
    world = World(_spec(dtype=torch.bfloat16), cls, "cpu", seed=3)
    reqs = [world.new_request() for _ in range(2)]
    step = world.plan(ForwardMode.EXTEND, reqs, [5, 9])
    world.backend.init_forward_metadata(step.batch)
    q = step.inputs["q"][:, 0]
    out = world.backend.forward(q, step.inputs["k"][:, 0], step.inputs["v"][:, 0], 0, step.batch)
    return f"returned {out.dtype} for {q.dtype} input" if out.dtype != q.dtype else ""


def _no_save_witness(cls) -> str:
    world = World(_spec(), cls, "cpu", seed=3)
    reqs = [world.new_request() for _ in range(2)]
    step = world.plan(ForwardMode.EXTEND, reqs, [5, 9])
    before = world.snapshot_kv()
    world.run_eager(step, save_kv_cache=False)
    for (k0, v0), (k1, v1) in zip(before, world.snapshot_kv()):
        if not (torch.equal(k0, k1) and torch.equal(v0, v1)):
            return "forward(save_kv_cache=False) wrote the KV cache"
    return ""


def _ops_witness(cls) -> str:
    """An engine's interleaved paged cache (block size 4, NaN where no key is), one prompt of
    11 tokens stored with two -1 padded tokens, attended with a window of 5: the last slot
    stays NaN and the output matches float64 attention."""
    from attnplug.oracle import exact_attention

    g = torch.Generator().manual_seed(5)
    ops = cls.paged_ops("cpu")
    P, hkv, D, H, n, window = 4, 2, 16, 4, 11, 5
    kv = torch.full((8, P, hkv, 2 * D), float("nan"))
    kc, vc = kv[..., :D], kv[..., D:]
    blocks = [6, 2, 5]
    slots = torch.tensor([blocks[i // P] * P + i % P for i in range(n)] + [-1, -1])
    k, v, q = (
        torch.randn(n + 2, hkv, D, generator=g),
        torch.randn(n + 2, hkv, D, generator=g),
        torch.randn(n, H, D, generator=g),
    )
    ops.store_kv(k, v, kc, vc, slots)
    if not bool(kv[-1, -1].isnan().all()):
        return "the -1 padding was stored in the cache's last slot"
    step = ops.plan(
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        torch.tensor([blocks + [0]], dtype=torch.int32),
        P,
        num_tokens=n,
        max_query_len=n,
        max_seq_len=n,
    )
    out = ops.attend(q, kc, vc, step, scale=0.25, window=window)
    exact = exact_attention(q.double(), k[None, :n].double(), v[None, :n].double(), [n], [n], window, 0.25)
    err = _relative_error(out, exact)
    return f"relative error {err:.3g} against float64 attention" if not err < 1e-4 else ""


def witness(cls) -> str:
    kind = cls.WITNESS[0]
    if kind == "output":
        return _output_witness(cls, cls.WITNESS[1], cls.WITNESS[2])
    return _WITNESSES[kind](cls)


_WITNESSES = {
    "sync": _sync_witness,
    "mapping": _mapping_witness,
    "dtype": _dtype_witness,
    "no_save": _no_save_witness,
    "ops": _ops_witness,
}


@pytest.mark.parametrize("cls", mutants.SUBTLE, ids=SUBTLE)
def test_mutant_is_really_wrong(cls):
    why = witness(cls)
    assert why, f"{cls.__name__}: its witness {cls.WITNESS[0]!r} shows nothing wrong"


@pytest.mark.parametrize("kind", ["output", *_WITNESSES])
def test_witnesses_pass_the_reference(kind):
    """Each demonstration shows nothing wrong for the reference backend itself."""
    if kind == "output":
        for cls in mutants.SUBTLE:
            if cls.WITNESS[0] == "output":
                assert _output_witness(ReferenceBackend, cls.WITNESS[1], cls.WITNESS[2]) == "", cls.__name__
    else:
        assert _WITNESSES[kind](ReferenceBackend) == ""
