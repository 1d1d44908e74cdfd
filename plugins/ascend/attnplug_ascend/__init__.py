"""attnplug plugin for Huawei Ascend NPUs, through torch_npu (NPU graphs).

Importing this package imports nothing from torch_npu: the probe looks for it, and the backend
module imports it when the backend is selected.
"""
