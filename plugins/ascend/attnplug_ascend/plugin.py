"""Registers the ``ascend`` backend (entry point ``ascend`` in the ``attnplug.backends`` group):
attention through torch_npu's fused operators (``npu_fused_infer_attention_score_v2``,
``npu_scatter_pa_kv_cache``), verified so far by emulating them on the host (tests/ascend), not
yet on Ascend hardware.

torch_npu is imported only inside the probe, and only when it is installed: importing it on a
machine without the CANN toolkit fails (or worse), so every failure is caught and reported as
the reason the backend is unavailable.
"""

from __future__ import annotations

import importlib.util

from attnplug.registry import ProbeResult, hookimpl

PLUGIN_API_VERSION = "1.0"

#: what every probe reason ends with: how the backend computes, and where that was verified
SERVES_WITH = (
    "serves with torch_npu's fused operators; emulated on the host (tests/ascend), not yet run on Ascend hardware"
)


def probe() -> ProbeResult:
    """Available when torch_npu is installed, imports, and sees at least one NPU."""
    try:
        spec = importlib.util.find_spec("torch_npu")
    except Exception as exc:  # a half-imported torch_npu in sys.modules
        return ProbeResult(False, f"cannot locate torch_npu: {type(exc).__name__}: {exc}")
    if spec is None:
        return ProbeResult(
            False, f"torch_npu is not installed (pip install 'attnplug[ascend]'; needs the CANN toolkit); {SERVES_WITH}"
        )
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except (Exception, SystemExit) as exc:  # typically: CANN libraries missing
        return ProbeResult(
            False,
            f"importing torch_npu failed: {type(exc).__name__}: {exc} "
            "(is the CANN toolkit installed and its set_env.sh sourced?)",
        )
    try:
        count = torch.npu.device_count()
    except Exception as exc:
        return ProbeResult(False, f"torch.npu.device_count() failed: {type(exc).__name__}: {exc}")
    if count == 0:
        return ProbeResult(False, "torch_npu imports but no Ascend NPU is visible (ASCEND_RT_VISIBLE_DEVICES?)")
    version = getattr(torch_npu, "__version__", "?")
    return ProbeResult(
        True, f"{count} Ascend NPU(s) visible, torch_npu {version}; {SERVES_WITH}", device=f"npu ({count} visible)"
    )


@hookimpl
def attnplug_register_backends(register):
    register(name="ascend", backend="attnplug_ascend.backend:AscendBackend", probe=probe, priority=100)
