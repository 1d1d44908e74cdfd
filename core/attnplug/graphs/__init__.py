"""Device graphs: the graph API a plugin supplies and the runner that captures/replays steps."""

from .buckets import captures_extend, default_extend_tokens
from .collector import collector_paused
from .device_graph import DeviceGraph, EagerGraph
from .runner import GraphCaptureError, GraphRunner, StepFn, captured_modes, default_bucket_sizes
from .stream_graph import PoolOps, StreamGraph, torch_pool_ops

__all__ = [
    "DeviceGraph",
    "EagerGraph",
    "GraphCaptureError",
    "GraphRunner",
    "PoolOps",
    "StreamGraph",
    "StepFn",
    "captured_modes",
    "captures_extend",
    "collector_paused",
    "default_bucket_sizes",
    "default_extend_tokens",
    "torch_pool_ops",
]
