"""What the checks share: rule names, tolerances, the configuration a backend is tested in,
twin-world comparisons and the instruments that watch a step (translation counter, mapping
poison, KV diff).

Everything here is device-neutral: tensors are compared on the host after the step, and the
only device services used are the backend class's ``new_graph()`` (through ``GraphRunner``),
``sync_guard()`` and ``synchronize(device)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type

import pytest
import torch

from attnplug import AttentionBackend, Capabilities, ForwardMode, GraphSupport, env
from attnplug.graphs import captured_modes

from .harness import ContractViolation, Step, World, WorldSpec
from .rules import (
    ALL_RULES,
    ATTENTION,
    CAPABILITIES,
    KV_SLOTS,
    REPLAY,
    RULE_1,
    RULE_2,
    RULE_3,
    SEQ_LENS_CPU_NONE,
)

__all__ = [
    "RULE_1",
    "RULE_2",
    "RULE_3",
    "ATTENTION",
    "REPLAY",
    "KV_SLOTS",
    "SEQ_LENS_CPU_NONE",
    "CAPABILITIES",
    "SUITE_DTYPES",
    "SUITE_HEAD_DIMS",
    "SUITE_PAGE_SIZES",
    "ATTENTION_TOL",
    "REPLAY_TOL",
    "BackendConstructionError",
    "probe_capabilities",
    "TestConfig",
    "base_config",
    "require",
    "graph_modes",
    "require_graph_mode",
    "env",
    "dtype_name",
    "conformance_check",
    "Twins",
    "PREFIX",
    "EXTEND_CHUNK",
    "DRAFT_TOKENS",
    "new_tokens_of",
    "assert_attention_close",
    "assert_caches_equal",
    "layer_kind",
    "TranslationProbe",
    "MappingPoison",
    "changed_rows",
    "DISABLE_PDL_ENV",
    "ALL_RULES",
    "poison_free_rows",
    "with_seq_lens_cpu",
    "assert_translation_not_identity",
    "spec_sizes",
]

# Rule names (``rules.py``): every failure message starts with one of them, so a report names
# the rule that broke. Re-exported here: the checks import them from this module.

DISABLE_PDL_ENV = env.DISABLE_PDL.name

# ---------------------------------------------------------------------------- what is tested
#: dtypes the suite knows a tolerance for, most precise first (the base config takes the first declared)
SUITE_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
SUITE_HEAD_DIMS: Tuple[int, ...] = (64, 128, 256)
SUITE_PAGE_SIZES: Tuple[int, ...] = (1, 4)

#: backend vs reference: elementwise ``|out - ref| <= atol + rtol * |ref|``. float32 allows
#: TF32-class matmuls; half types allow the probabilities to be rounded before P @ V.
ATTENTION_TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}
#: replay vs eager of the same backend: about one unit in the last place of the dtype
REPLAY_TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------- capabilities
class BackendConstructionError(RuntimeError):
    """The backend could not be constructed over any small pool the suite tried."""


_PROBE_SPECS = [
    dict(dtype=dtype, head_dim=hd, sliding_window=w)
    for w in (8, None)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for hd in (64, 128, 256)
]


@functools.lru_cache(maxsize=None)
def _probe(backend_cls: type, device: str) -> Capabilities:
    errors = []
    for kw in _PROBE_SPECS:
        spec = WorldSpec(
            num_layers=2, num_heads=4, num_kv_heads=2, size=64, size_swa=64, max_reqs=4, max_context_len=32, **kw
        )
        try:
            return World(spec, backend_cls, device).backend.capabilities()
        except Exception as exc:  # try the next shape; all failures are reported together
            errors.append(
                f"{dtype_name(kw['dtype'])}/head_dim {kw['head_dim']}/window {kw['sliding_window']}: "
                f"{type(exc).__name__}: {exc}"
            )
    raise BackendConstructionError(
        f"{backend_cls.__name__} could not be constructed on {device} over any small pool: "
        + "; ".join(errors[:4])
        + (f" (+{len(errors) - 4} more)" if len(errors) > 4 else "")
    )


def probe_capabilities(backend_cls: Type[AttentionBackend], device) -> Capabilities:
    """``capabilities()`` of ``backend_cls`` built over a small pool on ``device`` (cached
    per class and device). Raises ``BackendConstructionError`` listing what was tried."""
    return _probe(backend_cls, str(torch.device(device)))


@dataclass(frozen=True)
class TestConfig:
    """The shapes one check runs a backend in (chosen from its declared capabilities)."""

    __test__ = False  # not a test class

    dtype: torch.dtype
    head_dim: int
    page_size: int
    sliding_window: bool  # the backend supports SWA layers
    graphs: GraphSupport

    def spec(self, **overrides) -> WorldSpec:
        """A small ``WorldSpec`` in this config (4 layers: 3 SWA + 1 full when SWA is
        supported), updated with ``overrides``. The SWA pool is half the full pool and its
        free list is scrambled (``WorldSpec.scramble_swa``), so translation is never the
        identity."""
        size, size_swa = spec_sizes(self.page_size)
        base = WorldSpec(
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=self.head_dim,
            dtype=self.dtype,
            sliding_window=4 if self.sliding_window else None,
            page_size=self.page_size,
            size=size,
            size_swa=size_swa,
            max_reqs=12,
            max_context_len=64,
            scramble_swa=True,
        )
        if not self.sliding_window:
            overrides.pop("sliding_window", None)
        return replace(base, **overrides)


def spec_sizes(page_size: int, min_swa: int = 512) -> Tuple[int, int]:
    """``(size, size_swa)`` of a suite world: at least ``min_swa`` SWA slots and 24 SWA
    pages, the full pool twice as large (so SWA slots differ from full slots)."""
    pages = max(-(-min_swa // page_size), 24)
    return 2 * pages * page_size, pages * page_size


def require(condition: bool, reason: str) -> None:
    """Skip the running check unless ``condition`` (reason: what the capabilities declare)."""
    if not condition:
        pytest.skip(reason)


def _first_declared(wanted: Sequence, declared: Sequence, what: str, fmt=str):
    for value in wanted:
        if value in declared:
            return value
    pytest.skip(
        f"capabilities().{what} declares none of {', '.join(fmt(v) for v in wanted)} "
        f"(declared: {', '.join(fmt(v) for v in declared) or 'nothing'})"
    )


def base_config(caps: Capabilities, *, dtype=None, head_dim=None, page_size=None) -> TestConfig:
    """The config most checks use: the most precise declared dtype, the smallest declared
    head dim of {64, 128, 256} and the smallest declared page size of {1, 4}. An explicit
    value must be declared (else the check is skipped, naming the capability)."""
    if dtype is not None:
        require(dtype in caps.dtypes, f"capabilities().dtypes does not declare {dtype_name(dtype)}")
    else:
        dtype = _first_declared(SUITE_DTYPES, caps.dtypes, "dtypes", dtype_name)
    if head_dim is not None:
        require(head_dim in caps.head_dims, f"capabilities().head_dims does not declare {head_dim}")
    else:
        head_dim = _first_declared(SUITE_HEAD_DIMS, caps.head_dims, "head_dims")
    if page_size is not None:
        require(page_size in caps.page_sizes, f"capabilities().page_sizes does not declare {page_size}")
    else:
        page_size = _first_declared(SUITE_PAGE_SIZES, caps.page_sizes, "page_sizes")
    return TestConfig(dtype, head_dim, page_size, bool(caps.sliding_window), caps.graphs)


def graph_modes(level: GraphSupport) -> Tuple[ForwardMode, ...]:
    """The modes a ``GraphRunner`` captures for a backend of this ``GraphSupport`` level."""
    return captured_modes(GraphSupport(level))


def require_graph_mode(caps: Capabilities, mode: ForwardMode) -> None:
    require(
        mode in graph_modes(caps.graphs),
        f"capabilities().graphs is {GraphSupport(caps.graphs).name}: {mode.name} steps are not captured",
    )


@contextlib.contextmanager
def env(values: Optional[Mapping[str, Optional[str]]]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables inside the block, restore after."""
    values = dict(values or {})
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------- comparisons
def layer_kind(world: World, layer: int) -> str:
    if world.pool.is_swa_layer(layer):
        return f"SWA, window {world.spec.sliding_window}"
    return "full"


def assert_attention_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    world: World,
    *,
    what: str,
    rule: str = ATTENTION,
    tol: Optional[Tuple[float, float]] = None,
) -> None:
    """``[T, L, H, D]`` step outputs: elementwise ``|a - e| <= atol + rtol * |e|`` with the
    dtype's tolerance (``ATTENTION_TOL`` unless ``tol``); the message names the rule, the
    step, the worst layer (and its kind), token and head."""
    dtype = world.spec.dtype
    atol, rtol = tol if tol is not None else ATTENTION_TOL[dtype]
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        pytest.fail(f"{rule}: {what}: output shape {tuple(a.shape)}, expected {tuple(e.shape)}")
    if e.numel() == 0:
        return
    if not torch.isfinite(a).all():
        bad = torch.nonzero(~torch.isfinite(a))[0].tolist()
        pytest.fail(
            f"{rule}: {what}: non-finite output at token {bad[0]}, layer {bad[1]} "
            f"({layer_kind(world, bad[1])}), head {bad[2]}"
        )
    excess = (a - e).abs() - (atol + rtol * e.abs())
    if (excess > 0).any():
        flat = int(torch.argmax(excess))
        t, l, h, d = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
        n_bad = int((excess > 0).sum())
        pytest.fail(
            f"{rule}: {what}: layer {l} ({layer_kind(world, l)}) token {t} head {h}: "
            f"got {a[t, l, h, d]:.6g}, expected {e[t, l, h, d]:.6g} (|diff| {abs(a[t, l, h, d] - e[t, l, h, d]):.3g}; "
            f"{n_bad} of {a.numel()} values outside atol {atol:g} + rtol {rtol:g} for {dtype_name(dtype)})"
        )


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Host int64: rows (slots) of a ``[slots, Hkv, D]`` buffer whose values differ."""
    if before.shape == after.shape and torch.equal(before, after):
        return torch.zeros(0, dtype=torch.int64)
    diff = (before != after).flatten(1).any(1)
    return torch.nonzero(diff.cpu()).flatten()


def _show(rows: torch.Tensor, n: int = 8) -> str:
    rows = rows.tolist()
    return f"{rows[:n]}" + (f" (+{len(rows) - n} more)" if len(rows) > n else "")


def assert_caches_equal(
    world: World, other: World, *, what: str, rule: str = ATTENTION, ignore_rows: Sequence[int] = ()
) -> None:
    """Every layer's KV buffers bit-identical in two worlds (except ``ignore_rows``)."""
    for layer in range(world.spec.num_layers):
        for name, a, b in zip("kv", world.pool.get_kv_buffer(layer), other.pool.get_kv_buffer(layer)):
            rows = changed_rows(a, b)
            if len(ignore_rows):
                rows = rows[~torch.isin(rows, torch.tensor(list(ignore_rows), dtype=torch.int64))]
            if rows.numel():
                pytest.fail(
                    f"{rule}: {what}: layer {layer} ({layer_kind(world, layer)}) {name} cache differs "
                    f"from the reference at slots {_show(rows)}"
                )


# ---------------------------------------------------------------------------- instruments
class TranslationProbe:
    """Counts ``pool.translate_loc_from_full_to_swa`` calls by phase.

    While installed, the pool's translate and the backend's metadata methods and
    ``forward`` are wrapped (instance attributes, removed by ``uninstall``). Each translate
    call is recorded with the phase it happened in: ``"metadata"`` (inside one of the three
    metadata methods), ``"layer"`` (inside ``forward``) or ``"other"``. ``after_metadata``
    (optional callable) runs right after every metadata call returns, before any layer.
    """

    METADATA = (
        "init_forward_metadata",
        "init_forward_metadata_capture_cuda_graph",
        "init_forward_metadata_replay_cuda_graph",
    )

    def __init__(self, world: World, after_metadata=None):
        self.world = world
        self.after_metadata = after_metadata
        self.calls: List[Tuple[str, str]] = []  # (phase, metadata method or "forward")
        self.metadata_calls: List[str] = []
        self._phase: List[Tuple[str, str]] = []
        self._installed: List[Tuple[object, str, bool, object]] = []

    # -- wrapping
    def _wrap(self, obj, name, wrapper) -> None:
        own = name in vars(obj)
        original = getattr(obj, name)
        setattr(obj, name, wrapper(original))
        self._installed.append((obj, name, own, original))

    def install(self) -> "TranslationProbe":
        probe = self

        def translate_wrapper(original):
            def translate(loc):
                phase, where = probe._phase[-1] if probe._phase else ("other", "")
                probe.calls.append((phase, where))
                return original(loc)

            return translate

        def phase_wrapper(phase, where):
            def wrapper(original):
                def method(*args, **kwargs):
                    probe._phase.append((phase, where))
                    try:
                        result = original(*args, **kwargs)
                    finally:
                        probe._phase.pop()
                    if phase == "metadata":
                        probe.metadata_calls.append(where)
                        if probe.after_metadata is not None:
                            probe.after_metadata(where)
                    return result

                return method

            return wrapper

        self._wrap(self.world.pool, "translate_loc_from_full_to_swa", translate_wrapper)
        for name in self.METADATA:
            self._wrap(self.world.backend, name, phase_wrapper("metadata", name))
        self._wrap(self.world.backend, "forward", phase_wrapper("layer", "forward"))
        return self

    def uninstall(self) -> None:
        for obj, name, own, original in reversed(self._installed):
            if own:  # the object had its own attribute: put it back
                setattr(obj, name, original)
            else:  # the wrapper shadowed the class's method: remove it
                vars(obj).pop(name, None)
        self._installed.clear()

    def __enter__(self) -> "TranslationProbe":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- counts
    def reset(self) -> None:
        self.calls.clear()
        self.metadata_calls.clear()

    def count(self, phase: str) -> int:
        return sum(1 for p, _ in self.calls if p == phase)


class MappingPoison:
    """Rewrites ``pool.full_to_swa_index_mapping`` between the metadata call and the layers,
    for EVERY entry a step could read: the new tokens and the window prefix of each of its
    requests (the positions its queries' windows reach). A translation made in the layer
    loop (through the pool, a direct gather, or inside a kernel) then lands on other SWA
    slots than the one made in metadata: a store goes to the wrong slots and a window table
    gathered per layer reads random keys.

    Built before the step (host work happens here): ``original`` are the SWA slots of the
    new tokens (what metadata must translate to) and ``targets`` free SWA slots standing in
    for them; the window prefix gets its own free slots. Every target is filled with random
    values in every SWA layer. ``apply()`` (device writes only) points the entries at the
    targets; ``restore()`` puts the original entries back.
    """

    def __init__(self, world: World, step: Step, *, seed: int = 1234):
        self.world = world
        pool = world.pool
        self.loc = step.batch.out_cache_loc
        n = self.loc.shape[0]
        self.original = pool.translate_loc_from_full_to_swa(self.loc).to(torch.int64)  # [T] device
        prefix = self._window_prefix(world, step)  # [P] device int64, live entries only
        self.entries = torch.cat([self.loc.to(torch.int64), prefix])
        self.entries_original = pool.translate_loc_from_full_to_swa(self.entries).to(torch.int64)
        m = self.entries.shape[0]
        free = world.free_swa_slots()
        if free.numel() < m:
            raise RuntimeError(f"the test world has {free.numel()} free SWA slots, {m} needed to poison the mapping")
        all_targets = free[-m:].to(pool.device)  # the highest free slots: far from the step's own
        self.targets = all_targets[:n]
        self.prefix_entries = int(m - n)
        self._all_targets = all_targets
        gen = torch.Generator().manual_seed(seed)
        self.swa_layers = sorted(pool.swa_layer_ids)
        self.poison: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in self.swa_layers:
            kb, vb = pool.get_kv_buffer(layer)
            pk = torch.randn((m, *kb.shape[1:]), generator=gen).to(kb.device, kb.dtype)
            pv = torch.randn((m, *vb.shape[1:]), generator=gen).to(vb.device, vb.dtype)
            kb[all_targets] = pk
            vb[all_targets] = pv
            self.poison[layer] = (pk[:n], pv[:n])
        self.applied = 0

    @staticmethod
    def _window_prefix(world: World, step: Step) -> torch.Tensor:
        """Full slots of the positions before the step that its queries' windows reach and
        that still have an SWA slot."""
        W = world.spec.sliding_window
        if W is None or not step.requests:
            return torch.zeros(0, dtype=torch.int64, device=world.device)
        parts = []
        for r in step.requests:
            lo = max(0, r.seq_len - W)
            if r.seq_len > lo:
                parts.append(world.rows.req_to_token[r.row, lo : r.seq_len].to(torch.int64))
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=world.device)
        loc = torch.cat(parts)
        live = world.pool.translate_loc_from_full_to_swa(loc).to("cpu") > 0
        return loc[live.to(loc.device)]

    def apply(self) -> None:
        mapping = self.world.pool.full_to_swa_index_mapping
        mapping[self.entries] = self._all_targets.to(mapping.dtype)
        self.applied += 1

    def restore(self) -> None:
        mapping = self.world.pool.full_to_swa_index_mapping
        mapping[self.entries] = self.entries_original.to(mapping.dtype)


def poison_free_rows(world: World, seed: int) -> None:
    """Fill every KV row that holds no live token (slot 0, the padding sink, included) with
    seeded random values, in every layer. Twin worlds poisoned with one seed stay identical;
    a store outside the step's slots (a neighbour in the page, another layer, the sink) then
    shows up as a cache difference even when it writes zeros."""
    pool = world.pool
    live_full = world.live_full_slots().to(pool.device)
    live_swa = pool.translate_loc_from_full_to_swa(live_full).to(torch.int64) if pool.swa_layer_ids else None
    gen = torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        kb, vb = pool.get_kv_buffer(layer)
        keep = torch.zeros(kb.shape[0], dtype=torch.bool, device=kb.device)
        keep[live_swa[live_swa > 0] if pool.is_swa_layer(layer) else live_full] = True
        for buf in (kb, vb):
            noise = torch.randn(buf.shape, generator=gen).to(buf.device, buf.dtype)
            buf.copy_(torch.where(keep[:, None, None], buf, noise))


def with_seq_lens_cpu(batch):
    """The same step with the host mirror ``seq_lens_cpu`` supplied (an engine that mixes
    backends passes it even to a backend that does not need it)."""
    if batch.seq_lens_cpu is not None:
        return batch
    mirror = [int(x) for x in batch.seq_lens.to("cpu").tolist()]
    return dataclasses.replace(batch, seq_lens_cpu=mirror)


def assert_translation_not_identity(world: World, step: Step) -> None:
    """The suite's worlds make translation a real permutation (a backend that skips it must
    not pass by luck): raise when a step's SWA slots equal its full slots."""
    if world.spec.scramble_swa and world.translation_is_identity(step.batch.out_cache_loc):
        raise RuntimeError(
            "conformance harness: translate(out_cache_loc) equals out_cache_loc in a scrambled "
            "world; the suite would not see a backend that skips the translation"
        )


# ---------------------------------------------------------------------------- twin worlds
#: prompt lengths of the requests most checks set up before the step they test
PREFIX: Tuple[int, ...] = (5, 12, 9, 3, 7, 10)
#: new tokens per request of an EXTEND step on top of a prefix (chunked prefill)
EXTEND_CHUNK: Tuple[int, ...] = (4, 1, 7, 2, 5, 3)
#: q_len of the speculative modes
DRAFT_TOKENS = {ForwardMode.TARGET_VERIFY: 3, ForwardMode.DRAFT_EXTEND: 2}


def new_tokens_of(mode: ForwardMode, n: int):
    """``(new_tokens, num_draft_tokens)`` for ``World.plan`` of ``n`` requests in ``mode``."""
    if mode is ForwardMode.EXTEND:
        return list(EXTEND_CHUNK[:n]), None
    return None, DRAFT_TOKENS.get(mode)


def conformance_check(fn=None, *, rule: str = ATTENTION):
    """Mark a suite function as a test whatever its name (pytest's ``__test__``), and make
    every failure name a rule: an exception raised by the backend (or by the harness on its
    behalf) whose message names no rule is reported as ``"<rule>: <check> raised <type>:
    <message>"``. Use bare (``@conformance_check``) or with the check's ``rule``."""
    if fn is None:
        return functools.partial(conformance_check, rule=rule)

    @functools.wraps(fn)
    def check(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            text = str(exc)
            if text.startswith(ALL_RULES):
                pytest.fail(text, pytrace=False)
            pytest.fail(
                f"{rule}: {fn.__name__}: the backend raised {type(exc).__name__}: {text}{_where(exc)}", pytrace=True
            )

    check.__test__ = True
    return check


def _where(exc: BaseException) -> str:
    """`` (at file:line in function)`` of the innermost frame outside this suite and torch."""
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if not path.startswith(here) and not path.startswith(torch_dir):
            return f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    return ""


class Twins:
    """The world under test and a reference twin (same spec, same seed: same inputs, same
    slots), driven in lockstep. ``step`` runs one step in both and compares; then commits
    (optionally rolls back rejected drafts) and evicts out-of-window SWA slots in both.

    Before the first step every KV row holding no live token (the sink included) is filled
    with the same random values in both worlds (``poison_free_rows``); before each step its
    translation is checked not to be the identity. Then the world under test runs the step
    as an engine of its declaration would (``seq_lens_cpu`` only when the backend needs it)
    and, eager steps, once more with the ``seq_lens_cpu`` mirror supplied (``mirror=True``):
    both outputs must match the reference within the dtype's tolerance,
    and after each run every layer's KV cache must equal the reference's bit for bit (slot 0
    excepted in a padded replay)."""

    def __init__(self, world: World, ref: World, *, rule: str = ATTENTION, mirror: bool = True):
        self.world, self.ref, self.rule, self.mirror = world, ref, rule, mirror
        self.reqs: Tuple[list, list] = ([], [])
        self.steps = 0
        self._poisoned = False

    def requests(self, idx: Sequence[int]):
        return [self.reqs[0][i] for i in idx], [self.reqs[1][i] for i in idx]

    def setup(self, lengths: Sequence[int], *, direct: bool = False) -> None:
        """New requests prefilled by the REFERENCE backend in both worlds (identical KV),
        so that the step under test is the only one the backend runs. ``direct``: the
        prompts' KV is stored without attention (``World.store_kv``; long prompts)."""
        for w, reqs in zip((self.world, self.ref), self.reqs):
            if direct:
                new = [w.new_request() for _ in lengths]
                step = w.plan(ForwardMode.EXTEND, new, list(lengths))
                w.store_kv(step)
                w.advance(step)
                reqs.extend(new)
            else:
                reqs.extend(w.prefill(lengths, backend=w.reference_backend))

    def add(self, n: int) -> List[int]:
        """``n`` new (empty) requests in both worlds; returns their indices."""
        start = len(self.reqs[0])
        for w, reqs in zip((self.world, self.ref), self.reqs):
            reqs.extend(w.new_request() for _ in range(n))
        return list(range(start, start + n))

    def finish(self, i: int) -> None:
        for w, reqs in zip((self.world, self.ref), self.reqs):
            w.finish(reqs[i])
        self.reqs[0][i] = self.reqs[1][i] = None

    def _run(self, batch, inputs, runner, label: str, check_none: bool) -> torch.Tensor:
        try:
            if runner is not None:
                out = runner.run(batch, inputs).clone()
            else:
                self.world.backend.init_forward_metadata(batch)
                out = self.world.step_fn(batch, inputs)
            self.world.backend.synchronize(self.world.device)
            return out
        except ContractViolation as exc:
            pytest.fail(f"{exc} ({label})", pytrace=False)
        except Exception as exc:
            if str(exc).startswith(ALL_RULES):
                raise
            if check_none:
                pytest.fail(
                    f"{SEQ_LENS_CPU_NONE}: {label} raised {type(exc).__name__}: {exc} with "
                    "seq_lens_cpu=None (the backend declares needs_cpu_seq_lens=False)"
                )
            pytest.fail(f"{self.rule}: {label}: the backend raised {type(exc).__name__}: {exc}")

    def step(
        self,
        mode: ForwardMode,
        idx: Sequence[int] = (),
        new_tokens=None,
        *,
        num_draft_tokens=None,
        keep: Optional[Sequence[int]] = None,
        runner=None,
        what: str = "",
        check_seq_lens_cpu_none=False,
    ):
        """Run one step in both worlds and compare (see the class docstring). ``keep``: per
        request, how many of its tokens survive (rejected drafts are rolled back before
        eviction). ``runner``: run the world under test through this ``GraphRunner``
        instead of eagerly."""
        self.steps += 1
        wreqs, rreqs = self.requests(idx)
        sw = self.world.plan(mode, wreqs, new_tokens, num_draft_tokens=num_draft_tokens)
        sr = self.ref.plan(mode, rreqs, new_tokens, num_draft_tokens=num_draft_tokens)
        label = what or f"{mode.name} step {self.steps} (requests {list(idx)}" + (
            f", new tokens {list(new_tokens)})" if isinstance(new_tokens, (list, tuple)) else ")"
        )
        if check_seq_lens_cpu_none and sw.batch.seq_lens_cpu is not None:
            raise AssertionError("the harness built seq_lens_cpu although no backend needs it")
        assert_translation_not_identity(self.world, sw)
        if not self._poisoned:  # once: rows freed later keep old, distinct values
            for w in (self.world, self.ref):
                poison_free_rows(w, seed=1000)
            self._poisoned = True
        expected = self.ref.run_eager(sr)
        ignore = (0,) if runner is not None else ()
        runs = [(sw.batch, "")]
        if self.mirror and runner is None and sw.batch.seq_lens_cpu is None:  # a runner drops the mirror
            runs.append((with_seq_lens_cpu(sw.batch), " with the seq_lens_cpu mirror supplied"))
        out = None
        for i, (batch, how) in enumerate(runs):
            # The second run starts from the cache the first left: after the comparison
            # below, that differs from the start only at the step's own slots, which it
            # rewrites with the same values.
            out_i = self._run(batch, sw.inputs, runner, label + how, check_seq_lens_cpu_none and not i)
            assert_attention_close(out_i, expected, self.world, what=label + how, rule=self.rule)
            assert_caches_equal(
                self.world,
                self.ref,
                what=label + how,
                ignore_rows=ignore,
                rule=KV_SLOTS if self.rule == ATTENTION else self.rule,
            )
            out = out_i if out is None else out
        for w, s in ((self.world, sw), (self.ref, sr)):
            w.commit(s)
            if keep is not None:
                for r, k in zip(s.requests, keep):
                    w.rollback(r, k)
            for r in s.requests:
                w.evict(r)
        return sw, out
