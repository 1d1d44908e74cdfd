"""Peers ``flashinfer`` and ``flashinfer-fp8``: FlashInfer's batch decode on the ``hybrid_step``
world, attention only, in its best configuration.

FlashInfer is optional, never a dependency: it is imported when a peer first runs, and where
``import flashinfer`` fails the benchmark records one row saying why (``PeerUnavailable``).
``flashinfer`` runs on the bf16 world, ``flashinfer-fp8`` on its FP8 twin (the same keys
quantised, ``attnplug.bench.world``): ``kv_data_type`` float8_e4m3fn and each layer's
``k_scale`` / ``v_scale`` given to ``run()`` (the pool's per-layer scales, one value for every
head: FlashInfer takes one a layer; it folds ``k_scale`` into the logit scale and multiplies
the output by ``v_scale``, a launch of its own). For each DECODE batch size of ``hybrid_step``:

* **the keys** the backends attend (``attnplug.bench.world.request_keys``): on SWA layers the
  window's SWA slots, on full layers the ``req_to_token`` row;
* **every configuration** of ``CONFIGS``: page size 1 or 16, layout NHD or HND, tensor cores
  on or off, the wrapper in its CUDA-graph mode (``use_cuda_graph=True``, fixed buffers) or
  plain (planned, then its ``run`` captured in our graph). Page size 1 reads attnplug's own
  cache (``[S, Hkv, D]`` viewed as ``[S, 1, Hkv, D]`` NHD or ``[S, Hkv, 1, D]`` HND, the same
  bytes); page size 16 reads a copy of every layer's keys made in set-up (``paged_cache``: a
  request's keys in position order, its pages consecutive as a fresh pool hands them out).
  Per configuration two wrappers (SWA layers ``window_left = W - 1``, full layers ``-1``) are
  planned once outside the timed region; the ``L`` layers' attention is captured in ONE graph
  with the run's graph class and timed as attnplug's whole steps are (``Timer.replay_us``):
  every configuration briefly (``SEARCH``), then the fastest again as long as the variants
  are timed (``FINAL``). FlashInfer's JIT compiles its kernels once per process, in set-up,
  every module the configurations need at once (``compile_modules``);
* **checked**: every configuration's first SWA and first full layer against float32 attention
  over the same keys (dequantised): a configuration beyond ``CHECK_TOLERANCE`` is never the
  best, and the check row holds the largest difference of every configuration;
* **reported**: the fastest correct configuration (``best_config``), named first in the time
  row's detail and in its ``config`` field; every configuration's time in ``configs`` and the
  log.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from attnplug import ForwardMode
from attnplug.bench import Ctx
from attnplug.bench.step_case import PeerUnavailable
from attnplug.bench.step_check import CHECK_TOLERANCE, check_row, reference_attention
from attnplug.bench.world import HybridWorld, request_keys

__all__ = [
    "NAME",
    "FP8_NAME",
    "CONFIGS",
    "DecodeConfig",
    "ConfigResult",
    "best_config",
    "paged_cache",
    "layer_scales",
    "compile_modules",
    "import_flashinfer",
    "measure",
]

NAME = "flashinfer"
#: the same peer on the FP8 twin of the world
FP8_NAME = "flashinfer-fp8"
WORKSPACE_BYTES = 128 << 20
#: (replays a sample, samples) of a configuration while searching, for bs < 64 / bs >= 64
SEARCH = {False: (50, 3), True: (20, 3)}
#: the same for the configuration reported (as the variants are timed in hybrid_step)
FINAL = {False: (100, 5), True: (40, 5)}


@dataclass(frozen=True)
class DecodeConfig:
    """One way to run FlashInfer's batch decode: ``page_size`` (1: attnplug's cache itself;
    16: a paged copy), ``layout`` (``"NHD"`` / ``"HND"``), ``tensor_cores``
    (``use_tensor_cores``: the prefill kernel with the query heads of a KV head packed as rows)
    and ``graph_wrapper`` (``use_cuda_graph=True``: the wrapper's fixed-buffer CUDA-graph mode;
    False: a plain wrapper whose ``run`` is captured)."""

    page_size: int
    layout: str
    tensor_cores: bool
    graph_wrapper: bool

    def describe(self) -> str:
        """``page 16 HND, tensor cores, plain wrapper``."""
        cores = "tensor cores" if self.tensor_cores else "CUDA cores"
        wrapper = "use_cuda_graph wrapper" if self.graph_wrapper else "plain wrapper"
        return f"page {self.page_size} {self.layout}, {cores}, {wrapper}"

    def to_json(self) -> dict:
        return {
            "page_size": self.page_size,
            "layout": self.layout,
            "tensor_cores": self.tensor_cores,
            "use_cuda_graph": self.graph_wrapper,
        }


#: every configuration tried, in the order ties are broken (the bench's former one first)
CONFIGS: Tuple[DecodeConfig, ...] = tuple(
    DecodeConfig(page, layout, cores, graph)
    for page in (1, 16)
    for layout in ("NHD", "HND")
    for cores in (True, False)
    for graph in (True, False)
)


@dataclass(frozen=True)
class ConfigResult:
    """What one configuration gave: ``us`` per replay of every layer (None: it failed),
    ``diff`` its largest difference from float32 attention (None: not checked), ``error``
    why it failed."""

    us: Optional[float] = None
    diff: Optional[float] = None
    error: Optional[str] = None

    def eligible(self, tolerance: float = CHECK_TOLERANCE) -> bool:
        return self.error is None and self.us is not None and self.diff is not None and self.diff <= tolerance


def best_config(
    results: Mapping[DecodeConfig, ConfigResult], tolerance: float = CHECK_TOLERANCE
) -> Optional[Tuple[DecodeConfig, ConfigResult]]:
    """The fastest configuration that ran and computed the right attention (``diff <=
    tolerance``); a tie goes to the one first in ``results``' order. None when none did."""
    best: Optional[Tuple[DecodeConfig, ConfigResult]] = None
    for config, result in results.items():
        if result.eligible(tolerance) and (best is None or result.us < best[1].us):
            best = (config, result)
    return best


def import_flashinfer():
    """``flashinfer``, or ``PeerUnavailable`` saying why it cannot be imported."""
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install (missing runtime dependency)
        raise PeerUnavailable(
            f"flashinfer not installed: `import flashinfer` failed ({type(exc).__name__}: {exc})"
        ) from None
    return flashinfer


def paged_cache(
    cache: torch.Tensor, slots: torch.Tensor, page_size: int, layout: str
) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``cache [S, Hkv, D]`` as a paged cache of ``page_size`` in ``layout`` holding the keys at
    ``slots [bs, n]`` (int), and its table ``(indptr [bs + 1], indices, last_page_len [bs])``
    (int32, on the cache's device). Page size 1: the cache itself, viewed ``[S, 1, Hkv, D]``
    (NHD) or ``[S, Hkv, 1, D]`` (HND), the pages being the slots. Otherwise a copy: request
    ``b``'s keys in position order in pages ``b * m .. b * m + m - 1`` (``m = ceil(n / P)``),
    ``[bs * m, P, Hkv, D]`` (NHD) or ``[bs * m, Hkv, P, D]`` (HND), the last page's tail filled
    from slot 0 (never read: ``last_page_len``)."""
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
    bs, n = slots.shape
    dev = cache.device
    if page_size == 1:
        paged = cache.unsqueeze(1) if layout == "NHD" else cache.unsqueeze(2)
        indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * n
        return paged, (
            indptr,
            slots.reshape(-1).to(torch.int32).contiguous(),
            torch.ones(bs, dtype=torch.int32, device=dev),
        )
    m = -(-n // page_size)
    index = torch.zeros(bs, m * page_size, dtype=torch.int64, device=dev)
    index[:, :n] = slots.long()
    paged = cache[index.reshape(-1)].view(bs * m, page_size, *cache.shape[1:])
    if layout == "HND":
        paged = paged.transpose(1, 2).contiguous()
    indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * m
    indices = torch.arange(bs * m, dtype=torch.int32, device=dev)
    last = torch.full((bs,), n - (m - 1) * page_size, dtype=torch.int32, device=dev)
    return paged, (indptr, indices, last)


def layer_scales(world: HybridWorld) -> Optional[List[Tuple[float, float]]]:
    """Each layer's ``(k_scale, v_scale)`` as floats (an FP8 pool; None otherwise), read on the
    host in set-up. Raises ``ValueError`` when a layer's heads differ (FlashInfer takes one
    scale a layer)."""
    pool = world.pool
    if not pool.is_fp8:
        return None
    out = []
    for layer in range(world.num_layers):
        k, v = (s.tolist() for s in pool.kv_scales(layer))
        if len(set(k)) != 1 or len(set(v)) != 1:
            raise ValueError(
                f"layer {layer}: per-head scales {k} / {v}; FlashInfer takes one k_scale / v_scale a layer"
            )
        out.append((k[0], v[0]))
    return out


_compiled: set = set()
_compile_lock = threading.Lock()


def compile_modules(
    fi, world: HybridWorld, kv_cache_dtypes: Sequence[torch.dtype] = ()
) -> Tuple[float, Dict[str, str]]:
    """Have FlashInfer JIT-compile (or load) every decode module ``CONFIGS`` need (tensor cores
    on / off, a window or none) for the world's q dtype and head dim over each cache dtype of
    ``kv_cache_dtypes`` and the world's own, all at once: each planned on a tiny problem in its
    own thread (the compilers run in parallel); a module once per process. Returns
    ``(seconds, {module: error})`` (a module that failed fails its configurations again, with
    the error, when they are planned)."""
    dev = world.pool.device
    jobs: Dict[str, Callable[[], None]] = {}
    with _compile_lock:
        for kv_dtype in dict.fromkeys((world.pool.dtype, *kv_cache_dtypes)):
            for cores in (True, False):
                for window_left in (world.window - 1, -1):
                    key = (world.dtype, kv_dtype, world.head_dim, cores, window_left >= 0)
                    if key in _compiled:
                        continue
                    _compiled.add(key)

                    def job(kv_dtype=kv_dtype, cores=cores, window_left=window_left) -> None:
                        one = torch.ones(1, dtype=torch.int32, device=dev)
                        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD", use_tensor_cores=cores
                        )
                        wrapper.plan(
                            torch.arange(2, dtype=torch.int32, device=dev),
                            one,
                            one,
                            world.num_heads,
                            world.num_kv_heads,
                            world.head_dim,
                            1,
                            window_left=window_left,
                            q_data_type=world.dtype,
                            kv_data_type=kv_dtype,
                        )

                    name = str(kv_dtype).replace("torch.", "")
                    jobs[f"{name}, {'tensor' if cores else 'CUDA'} cores, window_left {window_left}"] = job
    return run_jobs(jobs)


def run_jobs(jobs: Mapping[str, Callable[[], None]]) -> Tuple[float, Dict[str, str]]:
    """Run ``jobs`` (name -> a JIT compile) at once in threads: ``(seconds, {name: first line of
    its error})`` (FlashInfer's module builds run outside the GIL)."""
    if not jobs:
        return 0.0, {}
    t0 = time.monotonic()
    failures: Dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        for name, future in futures.items():
            try:
                future.result()
            except Exception as exc:
                failures[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return time.monotonic() - t0, failures


class _Layout:
    """Every layer's K/V and the two tables of one (page size, layout) for ``bs`` requests."""

    def __init__(self, world: HybridWorld, keys: Dict[bool, torch.Tensor], page_size: int, layout: str) -> None:
        self.caches: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.tables: Dict[bool, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for layer in range(world.num_layers):
            kind = world.pool.is_swa_layer(layer)
            k, v = world.pool.get_kv_buffer(layer)
            k_paged, table = paged_cache(k, keys[kind], page_size, layout)
            v_paged, _ = paged_cache(v, keys[kind], page_size, layout)
            self.caches.append((k_paged, v_paged))
            self.tables.setdefault(kind, table)


def _wrapper(fi, config: DecodeConfig, table, window_left: int, world: HybridWorld, scale: float, workspace):
    """A decode wrapper of ``config`` planned for ``table`` (``paged_cache``'s)."""
    indptr, indices, last = table
    graph = {}
    if config.graph_wrapper:
        graph = dict(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.empty_like(indptr),
            paged_kv_indices_buffer=torch.empty_like(indices),
            paged_kv_last_page_len_buffer=torch.empty_like(last),
        )
    workspace.zero_()
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace, kv_layout=config.layout, use_tensor_cores=config.tensor_cores, **graph
    )
    wrapper.plan(
        indptr,
        indices,
        last,
        world.num_heads,
        world.num_kv_heads,
        world.head_dim,
        config.page_size,
        pos_encoding_mode="NONE",
        window_left=window_left,
        q_data_type=world.dtype,
        kv_data_type=world.pool.dtype,
        sm_scale=scale,
    )
    return wrapper


class _Case:
    """One batch size's fixed parts: the keys, q, the output, the float32 references of the
    first SWA and full layer, the scales, the workspaces."""

    def __init__(self, world: HybridWorld, bs: int) -> None:
        pool, L = world.pool, world.num_layers
        seq_len = world.context - world.num_draft + 1  # a DECODE step of the world (world.py)
        self.world, self.bs = world, bs
        self.scale = 1.0 / math.sqrt(world.head_dim)
        full, swa = request_keys(world, bs, seq_len)
        self.keys = {True: swa, False: full}
        gen = torch.Generator(device=pool.device).manual_seed(2)
        self.q = torch.randn(L, bs, world.num_heads, world.head_dim, generator=gen, device=pool.device).to(world.dtype)
        self.out = torch.empty_like(self.q)
        self.kinds = [pool.is_swa_layer(layer) for layer in range(L)]
        self.scales = layer_scales(world)
        self.workspaces = {
            kind: torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device) for kind in (True, False)
        }
        self.checked: Dict[bool, Tuple[int, torch.Tensor]] = {}
        for layer, kind in enumerate(self.kinds):
            if kind in self.checked:
                continue
            k_cache, v_cache = pool.get_kv_buffer(layer)
            k_scale, v_scale = pool.kv_scales(layer)
            ref = reference_attention(self.q[layer], k_cache, v_cache, self.keys[kind], self.scale, k_scale, v_scale)
            self.checked[kind] = (layer, ref)

    def run(self, ctx: Ctx, fi, config: DecodeConfig, layout: _Layout, calls: int, repeats: int):
        """``(us, {kind: (layer, diff)})`` of ``config`` on ``layout``."""
        world = self.world
        wrappers = {
            kind: _wrapper(fi, config, layout.tables[kind], world.window - 1 if kind else -1, world, self.scale, ws)
            for kind, ws in self.workspaces.items()
            if kind in layout.tables
        }
        q, out, caches, kinds, scales = self.q, self.out, layout.caches, self.kinds, self.scales

        def every_layer() -> torch.Tensor:
            for layer in range(world.num_layers):
                fp8 = {} if scales is None else {"k_scale": scales[layer][0], "v_scale": scales[layer][1]}
                wrappers[kinds[layer]].run(q[layer], caches[layer], out=out[layer], **fp8)
            return out

        every_layer()
        ctx.timer.sync()
        diffs = {
            kind: (layer, (out[layer].float() - ref).abs().max().item()) for kind, (layer, ref) in self.checked.items()
        }
        us = ctx.timer.replay_us(every_layer, calls=calls, repeats=repeats)
        return us, diffs


def measure(
    ctx: Ctx,
    world: HybridWorld,
    mode: ForwardMode,
    bs: int,
    *,
    bench: str = "hybrid_step",
    kv_cache_dtypes: Sequence[torch.dtype] = (),
):
    """``(microseconds per replay of every layer's decode attention in the best configuration,
    detail, fields)`` for the first ``bs`` requests (the module docstring); appends the check
    row to ``ctx.rows``. ``fields``: ``config`` (the best), ``configs`` (each one's ``us``,
    ``max_abs_out_diff`` or ``error``). ``kv_cache_dtypes``: the caches the benchmark's other
    FlashInfer peers read, whose modules are compiled with this one's at the first call."""
    if mode is not ForwardMode.DECODE:
        raise ValueError(f"the flashinfer peer runs DECODE steps only, got {mode.name}")
    fi = import_flashinfer()
    name = FP8_NAME if world.pool.is_fp8 else NAME
    compile_s, compile_failures = compile_modules(fi, world, kv_cache_dtypes)
    if compile_s:
        failed = f"; failed: {compile_failures}" if compile_failures else ""
        ctx.log(f"  {name}: FlashInfer's decode modules compiled or loaded in {compile_s:.1f} s{failed}")
    case = _Case(world, bs)
    big = bs >= 64
    results: Dict[DecodeConfig, ConfigResult] = {}
    worst: Dict[str, Tuple[int, float]] = {}
    t0 = time.monotonic()
    for page, layout_name in dict.fromkeys((c.page_size, c.layout) for c in CONFIGS):
        layout = _Layout(world, case.keys, page, layout_name)
        for config in (c for c in CONFIGS if (c.page_size, c.layout) == (page, layout_name)):
            try:
                us, diffs = case.run(ctx, fi, config, layout, *SEARCH[big])
            except Exception as exc:
                results[config] = ConfigResult(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                continue
            results[config] = ConfigResult(us=us, diff=max(d for _, d in diffs.values()))
            for kind, (layer, d) in diffs.items():
                label = "SWA" if kind else "full"
                if label not in worst or d > worst[label][1]:
                    worst[label] = (layer, d)
        del layout
    search_s = time.monotonic() - t0
    ranked = sorted((r.us, c.describe()) for c, r in results.items() if r.us is not None)
    ctx.log(f"  decode bs={bs} {name} configurations: " + "; ".join(f"{d} {us:.1f} us" for us, d in ranked))
    for config, result in results.items():
        if result.error:
            ctx.log(f"  decode bs={bs} {name} {config.describe()}: FAILED {result.error}")
    if worst:
        ctx.rows.append(check_row(bench, f"decode bs={bs}", name, worst, world, key=bs == 1))
    chosen = best_config(results)
    if chosen is None:
        raise RuntimeError(f"no configuration of {name} ran and computed the right attention: {_summary(results)}")
    best, _ = chosen
    us, diffs = case.run(ctx, fi, best, _Layout(world, case.keys, best.page_size, best.layout), *FINAL[big])
    version = getattr(fi, "__version__", "?")
    fp8 = " FP8 e4m3, per-layer k_scale / v_scale at run;" if world.pool.is_fp8 else ""
    ok = sum(1 for r in results.values() if r.eligible())
    detail = (
        f"best of {ok}/{len(CONFIGS)}: {best.describe()}; flashinfer {version},{fp8} {world.num_layers} layers' "
        f"decode attention in one graph, window_left {world.window - 1} on SWA layers; "
        f"search {search_s:.1f} s; check max diff {max(d for _, d in diffs.values()):.1e}"
    )
    fields = {
        "config": best.to_json(),
        "configs": [
            {**c.to_json(), "us": r.us, "max_abs_out_diff": r.diff, "error": r.error} for c, r in results.items()
        ],
    }
    return us, detail, fields


def _summary(results: Mapping[DecodeConfig, ConfigResult]) -> str:
    return "; ".join(f"{c.describe()}: {r.error or f'max diff {r.diff:.2e}'}" for c, r in results.items())
