"""The example plugin's device part: what a device gives the core (graphs, a sync guard,
synchronisation, facts for ``attnplug info``).

This plugin runs wherever PyTorch does, so it keeps the core's defaults: graphs through the
eager stand-in, no sync guard. A real plugin overrides ``new_graph`` (its device's graph
class), ``sync_guard`` (its runtime's strict mode, if any) and ``synchronize``, and sets
``device_type``.
"""

from attnplug.device_part import DevicePart


class ExampleDevice(DevicePart):
    device_type = "any"

    def describe(self):
        return {"graph_class": "eager stand-in (attnplug.graphs.EagerGraph)"}
