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
"""

from __future__ import annotations

import gc
import itertools
from collections import Counter
from typing import Dict, List, Optional

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
