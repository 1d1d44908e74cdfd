"""Device graphs: the graph API a plugin supplies and the runner that captures/replays steps."""

from .device_graph import DeviceGraph, EagerGraph
from .stream_graph import StreamGraph
from .runner import GraphRunner, StepFn, default_bucket_sizes

__all__ = ["DeviceGraph", "EagerGraph", "GraphRunner", "StreamGraph", "StepFn", "default_bucket_sizes"]
