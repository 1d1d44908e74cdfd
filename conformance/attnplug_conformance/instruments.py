"""Instruments that watch or disturb a step: ``TranslationProbe`` counts the full-to-SWA
translations by phase, ``MappingPoison`` rewrites the mapping between the metadata call and the
layers, ``poison_free_rows`` fills every KV row that holds no live token with random values, NaN or
±Inf (an FP8 cache: NaN bytes, its largest finite magnitudes, and ±Inf where the format has them).
Every write into a KV buffer goes through its bits (``harness.kv_bits``), so FP8 buffers take them
on any device.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch

from attnplug.memory.fp8 import fp8_max, is_fp8

from .harness import Step, World, kv_bits

__all__ = ["TranslationProbe", "MappingPoison", "POISONS", "poison_free_rows"]


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
    targets; ``restore()`` puts the original entries back. The poison is written in the
    buffers' dtype (an FP8 cache: N(0, 1) noise quantised without a scale).
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
            pk = torch.randn((m, *kb.shape[1:]), generator=gen).to(kb.dtype).to(kb.device)
            pv = torch.randn((m, *vb.shape[1:]), generator=gen).to(vb.dtype).to(vb.device)
            kv_bits(kb)[all_targets] = kv_bits(pk)
            kv_bits(vb)[all_targets] = kv_bits(pv)
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


#: what ``poison_free_rows`` writes: seeded N(0, 1) noise, NaN, ±Inf (alternating along the
#: head dim), or a mix (every element one of the specials or noise, drawn at random). An FP8
#: cache has its own specials (``_specials``): NaN bytes and its largest finite magnitudes ±max,
#: and ±Inf where the format has them (float8_e5m2; float8_e4m3fn has none).
POISONS = ("noise", "nan", "inf", "mixed")


def _specials(dtype: torch.dtype) -> torch.Tensor:
    """The special values a poisoned row of ``dtype`` may hold (float32): NaN, +Inf, -Inf; an FP8
    dtype: NaN, +max, -max, and +Inf, -Inf for float8_e5m2."""
    if not is_fp8(dtype):
        return torch.tensor([math.nan, math.inf, -math.inf])
    top = fp8_max(dtype)
    values = [math.nan, top, -top]
    if torch.tensor(math.inf).to(dtype).float().isinf():  # the format has an infinity (e5m2)
        values += [math.inf, -math.inf]
    return torch.tensor(values)


def _poison(buf: torch.Tensor, fill: str, gen: torch.Generator) -> torch.Tensor:
    """``fill`` values of ``buf``'s shape and dtype on ``buf``'s device (converted on the host)."""
    noise = torch.randn(buf.shape, generator=gen)
    specials = _specials(buf.dtype)
    if fill == "noise":
        value = noise
    elif fill == "nan":
        value = torch.full(buf.shape, math.nan)
    elif fill == "inf":  # the non-NaN specials, alternating along the head dim
        extremes = specials[1:]
        value = extremes[torch.arange(buf.shape[-1]) % len(extremes)].expand(buf.shape).clone()
    elif fill == "mixed":
        pick = torch.randint(0, len(specials) + 1, buf.shape, generator=gen)
        value = torch.where(pick < len(specials), specials[pick.clamp_max(len(specials) - 1)], noise)
    else:
        raise ValueError(f"poison_free_rows: fill must be one of {', '.join(POISONS)}, not {fill!r}")
    return value.to(buf.dtype).to(buf.device)


def poison_free_rows(world: World, seed: int, fill: str = "noise") -> None:
    """Fill every KV row that holds no live token (slot 0, the padding sink, the slots past a
    request's end in its last page, evicted and freed slots, the slots a planned step is about
    to write) with ``fill`` (``POISONS``), in every layer. With ``"noise"``, twin worlds
    poisoned with one seed stay identical and a store outside the step's slots (a neighbour
    in the page, another layer, the sink) shows up as a cache difference even when it writes
    zeros; NaN and ±Inf are what a real cache may hold there (uninitialised memory, stale
    values), which a kernel must never let reach an output (``0 * NaN`` is NaN). An FP8 cache
    gets its own specials: NaN bytes, ±max, and ±Inf in float8_e5m2 (``_specials``)."""
    pool = world.pool
    live_full = world.live_full_slots().to(pool.device)
    live_swa = pool.translate_loc_from_full_to_swa(live_full).to(torch.int64) if pool.swa_layer_ids else None
    gen = torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        kb, vb = pool.get_kv_buffer(layer)
        keep = torch.zeros(kb.shape[0], dtype=torch.bool, device=kb.device)
        keep[live_swa[live_swa > 0] if pool.is_swa_layer(layer) else live_full] = True
        for buf in (kb, vb):
            bits = kv_bits(buf)
            bits.copy_(torch.where(keep[:, None, None], bits, kv_bits(_poison(buf, fill, gen))))
