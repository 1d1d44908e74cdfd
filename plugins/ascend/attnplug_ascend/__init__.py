"""attnplug plugin for Huawei Ascend NPUs: attention through torch_npu's fused operators
(``npu_fused_infer_attention_score_v2``, ``npu_scatter_pa_kv_cache``), NPU graphs.

Importing this package imports nothing from torch_npu: the probe looks for it, and the backend
resolves the operators (``ops.load_ops``) when it is constructed. See docs/ascend.md.
"""
