"""A fake device module with stream-capture graphs, for testing ``StreamGraph`` on the host.

It mirrors what ``StreamGraph`` uses of a PyTorch device module and how the real one fails:

* ``graph(g, pool=...)`` switches to its own capture stream, calls ``g.capture_begin(pool)``
  (the allocator starts recording into ``pool``: "already recording" if it is), and on exit
  ``g.capture_end()`` then restores the stream. When ``capture_end`` raises, the stream is
  NOT restored (as in ``torch.cuda.graph.__exit__``).
* A capture is invalidated by an illegal call on a capturing stream: ``launch()`` with
  ``fail_next_launch`` set, or a captured graph destroyed (``__del__``) during a capture.
  Ending an invalidated capture raises; with ``ends_pool_on_failure=False`` (some PyTorch
  versions) the allocator is then left recording and the capture's pool reference is kept.
* ``allocator`` counts pool references and records which pools are being recorded into; a
  pool whose last reference is released is refused for later captures (as PyTorch's caching
  allocator asserts while it still holds the pool's blocks);
  ``pool_ops()`` gives ``StreamGraph`` its end/release calls.

``FakeDevice`` graphs compute nothing on replay. ``TapeGraph`` is the stand-in that replays like
a device graph: capture runs the step once and records every aten op and every Triton
(interpreter) kernel launch with the very tensors it touched; ``replay()`` re-executes that tape
over those same tensors and runs no Python of the step (a Python branch on a value, which the
host allows, is frozen as the capture took it). A replay therefore reads the buffers the
capture read, at their "addresses": if the backend's metadata has since moved to other buffers,
the replay does not see them, exactly as a GPU graph would not. ``EagerGraph`` (the core's host
stand-in) re-runs the Python step, which reads whatever the backend holds now, and hides that.
``use_tape_graphs(backend)`` makes a backend's ``new_graph()`` return ``TapeGraph``s.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from attnplug.graphs import PoolOps

_instances = itertools.count()


class FakeAllocator:
    def __init__(self) -> None:
        self.recording: Dict[tuple, object] = {}
        self.refs: Counter = Counter()
        self.released: set = set()  # pools whose last reference went: never captured into again

    def begin(self, pool: tuple, graph: object) -> None:
        if pool in self.released:  # as PyTorch's create_or_incref_pool while it frees the pool
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (CUDACachingAllocator)")
        self.refs[pool] += 1
        if pool in self.recording:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.recording[pool] = graph

    def end(self, device: int, pool: tuple) -> None:
        if pool not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        del self.recording[pool]

    def release(self, device: int, pool: tuple) -> None:
        self.refs[pool] -= 1
        if self.refs[pool] < 0:
            raise AssertionError(f"pool {pool} released more often than acquired")
        if self.refs[pool] == 0:
            self.released.add(pool)


class FakeDevice:
    """An object shaped like a ``torch.<device>`` module (see module docstring)."""

    def __init__(self, *, ends_pool_on_failure: bool = False) -> None:
        self.__name__ = f"fakedev{next(_instances)}"  # StreamGraph shares one pool per module name
        self.ends_pool_on_failure = ends_pool_on_failure
        self.allocator = FakeAllocator()
        self.default = FakeStream(self, "default")
        self.current = self.default
        self.capture_stream = FakeStream(self, "capture")
        self.capturing: Optional["FakeGraph"] = None
        self.invalidated = False
        self.fail_next_launch = False
        self.launches: List[bool] = []  # per launch: inside a capture?
        self.destroyed_during_capture = 0
        self._next_pool = 0
        device = self

        class Graph(FakeGraph):
            def __init__(self) -> None:
                super().__init__(device)

        self.FakeGraph = Graph

    # --- what StreamGraph uses
    def Stream(self) -> "FakeStream":
        return FakeStream(self, "side")

    def current_stream(self) -> "FakeStream":
        return self.current

    def current_device(self) -> int:
        return 0

    def graph_pool_handle(self) -> tuple:
        self._next_pool += 1
        return (0, self._next_pool)

    def stream(self, s: "FakeStream") -> "_StreamContext":
        return _StreamContext(self, s)

    def graph(self, g: "FakeGraph", pool=None) -> "_GraphContext":
        return _GraphContext(self, g, pool)

    def pool_ops(self) -> PoolOps:
        return PoolOps(end_recording=self.allocator.end, release=self.allocator.release)

    # --- what a step does
    def launch(self) -> None:
        """One kernel launch of a step."""
        self.launches.append(self.capturing is not None)
        if self.capturing is not None:
            if self.fail_next_launch:
                self.fail_next_launch = False
                self.invalidated = True
                raise RuntimeError("operation not permitted when stream is capturing")
            if self.invalidated:
                raise RuntimeError("operation failed due to a previous error during capture")


class FakeStream:
    def __init__(self, device: FakeDevice, name: str) -> None:
        self.device, self.name = device, name

    def wait_stream(self, other: "FakeStream") -> None:
        pass


class FakeGraph:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.pool: Optional[tuple] = None
        self.began = self.ended = False
        self.gc_enabled_at_begin: Optional[bool] = None
        self.replays = 0

    def capture_begin(self, pool: tuple) -> None:
        dev = self.device
        self.gc_enabled_at_begin = gc.isenabled()
        dev.allocator.begin(pool, self)
        self.pool, self.began = pool, True
        dev.capturing, dev.invalidated = self, False

    def capture_end(self) -> None:
        dev = self.device
        dev.capturing = None
        if dev.invalidated:
            dev.invalidated = False
            if dev.ends_pool_on_failure:
                dev.allocator.end(0, self.pool)
            raise RuntimeError("operation failed due to a previous error during capture (capture invalidated)")
        dev.allocator.end(0, self.pool)
        self.ended = True

    def replay(self) -> None:
        if not self.ended:
            raise RuntimeError("replay without a successful capture")
        self.replays += 1

    def __del__(self) -> None:
        dev = self.device
        if dev.capturing is not None:  # destroying a graph on a capturing stream is illegal
            dev.invalidated = True
            dev.destroyed_during_capture += 1
        if self.ended or (self.began and dev.ends_pool_on_failure):
            dev.allocator.release(0, self.pool)


class _StreamContext:
    """Like ``torch.cuda.StreamContext``: restores the previous stream in ``__exit__`` only."""

    def __init__(self, device: FakeDevice, s: FakeStream) -> None:
        self.device, self.stream, self.prev = device, s, None

    def __enter__(self) -> None:
        self.prev, self.device.current = self.device.current, self.stream

    def __exit__(self, *exc) -> None:
        self.device.current = self.prev


class _GraphContext:
    def __init__(self, device: FakeDevice, graph: FakeGraph, pool) -> None:
        self.device, self.graph = device, graph
        self.pool = pool if pool is not None else device.graph_pool_handle()
        self._stream_ctx = device.stream(device.capture_stream)

    def __enter__(self) -> None:
        self._stream_ctx.__enter__()
        self.graph.capture_begin(self.pool)

    def __exit__(self, *exc) -> None:
        self.graph.capture_end()  # when this raises, the stream is not restored
        self._stream_ctx.__exit__(*exc)


# ---------------------------------------------------------------- a graph that replays its tape
#: ops whose result is fresh memory with no defined values: replay keeps the captured tensor
_ALLOCATING = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _Op:
    """One recorded aten call: the function, the captured arguments, the captured outputs."""

    def __init__(self, func, args, kwargs, out) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs = tree_flatten(out)[0]

    def replay(self) -> None:
        if self.func.overloadpacket.__name__ in _ALLOCATING:
            return  # the captured tensor is this allocation's fixed address
        new = tree_flatten(self.func(*self.args, **self.kwargs))[0]
        for rec, got in zip(self.outs, new):
            if not isinstance(rec, torch.Tensor) or not isinstance(got, torch.Tensor) or _same_memory(rec, got):
                continue  # in place, or a view of captured memory: already where the tape reads it
            if got.shape != rec.shape:
                raise RuntimeError(f"{self.func}: replay made shape {tuple(got.shape)}, capture {tuple(rec.shape)}")
            rec.copy_(got)  # a fresh result goes where the capture's result lives


class _Launch:
    """One recorded Triton interpreter launch: the grid executor and its captured arguments."""

    def __init__(self, call: Callable, executor: Any, args: tuple, kwargs: dict) -> None:
        self.call, self.executor, self.args, self.kwargs = call, executor, args, kwargs

    def replay(self) -> None:
        self.call(self.executor, *self.args, **self.kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list) -> None:
        super().__init__()
        self.tape = tape
        self.paused = 0  # inside a recorded kernel launch: its own tensor ops are part of it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            self.tape.append(_Op(func, args, kwargs, out))
        return out


@contextlib.contextmanager
def _recording_launches(recorder: _Recorder) -> Iterator[None]:
    interp = sys.modules.get("triton.runtime.interpreter")
    executor = getattr(interp, "GridExecutor", None)
    if executor is None:  # no Triton interpreter in this process: aten ops only
        yield
        return
    original = executor.__call__

    def recording(self, *args, **kwargs):
        if recorder.paused:
            return original(self, *args, **kwargs)
        recorder.paused += 1
        try:
            original(self, *args, **kwargs)
        finally:
            recorder.paused -= 1
        recorder.tape.append(_Launch(original, self, args, kwargs))

    executor.__call__ = recording
    try:
        yield
    finally:
        executor.__call__ = original


class TapeGraph:
    """A ``DeviceGraph`` on the host that replays its captured work over the captured tensors
    (see the module docstring). ``replays`` counts replays."""

    def __init__(self) -> None:
        self.tape: Optional[List[Any]] = None
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        tape: List[Any] = []
        recorder = _Recorder(tape)
        with _recording_launches(recorder), recorder:
            out = fn()  # if this raises, nothing is kept
        self.tape = tape
        return out

    def replay(self) -> None:
        if self.tape is None:
            raise RuntimeError("replay() before capture()")
        with torch.no_grad():
            for entry in self.tape:
                entry.replay()
        self.replays += 1


def use_tape_graphs(backend) -> List[TapeGraph]:
    """Make ``backend.new_graph()`` return ``TapeGraph``s; returns the list of those it made."""
    made: List[TapeGraph] = []

    def new_graph() -> TapeGraph:
        made.append(TapeGraph())
        return made[-1]

    backend.new_graph = new_graph
    return made
