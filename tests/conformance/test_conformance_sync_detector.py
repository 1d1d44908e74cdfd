"""The conformance suite's device-neutral host-sync detector (rule 2)."""

import pytest
import torch

from attnplug_conformance.sync_detector import RULE, HostSyncError, SyncDetector

x = torch.arange(6)
mask = x > 2

FLAGGED = {
    "Tensor.item": lambda: x[0].item(),
    "Tensor.tolist": lambda: x.tolist(),
    "Tensor.cpu": lambda: x.cpu(),
    "Tensor.numpy": lambda: x.numpy(),
    "Tensor.__bool__": lambda: bool(x[0]),
    "Tensor.__bool__ (if)": lambda: 1 if x[1] else 0,
    "Tensor.__int__": lambda: int(x[0]),
    "Tensor.__float__": lambda: float(x[0]),
    "Tensor.__index__": lambda: [1, 2, 3][x[1]],
    "torch.nonzero": lambda: torch.nonzero(x),
    "Tensor.nonzero": lambda: x.nonzero(),
    "torch.argwhere": lambda: torch.argwhere(x),
    "torch.where(cond)": lambda: torch.where(mask),
    "mask __getitem__": lambda: x[mask],
    "mask __getitem__ in tuple": lambda: x.view(2, 3)[mask.view(2, 3)[:, 0], :],
    "mask __setitem__": lambda: x.clone().__setitem__(mask, 0),
    "torch.masked_select": lambda: torch.masked_select(x, mask),
    "Tensor.masked_select": lambda: x.masked_select(mask),
    "torch.tensor(list)": lambda: torch.tensor([1, 2, 3]),
    "torch.tensor(int)": lambda: torch.tensor(3),
    "torch.as_tensor(list)": lambda: torch.as_tensor([1, 2]),
    "torch.unique": lambda: torch.unique(x),
    "torch.equal": lambda: torch.equal(x, x),
    "repeat_interleave(tensor)": lambda: torch.repeat_interleave(x, x),
    "Tensor.__repr__": lambda: repr(x),
    "Tensor.__format__": lambda: f"{x[0]:d}",
}

ALLOWED = {
    "torch.full": lambda: torch.full((3,), 2, dtype=torch.int64),
    "torch.arange": lambda: torch.arange(4),
    "cumsum": lambda: torch.cumsum(x, 0),
    "int-tensor indexing": lambda: x[torch.full((2,), 1)],
    "int-tensor setitem": lambda: x.clone().__setitem__(torch.full((2,), 1), 0),
    "slicing": lambda: x[1:3],
    "torch.where(c, a, b)": lambda: torch.where(mask, x, 0),
    "searchsorted": lambda: torch.searchsorted(x, x),
    "masked_fill": lambda: x.masked_fill(mask, 0),
    "repeat_interleave(output_size)": lambda: torch.repeat_interleave(x, x, output_size=15),
    "repeat_interleave(int)": lambda: torch.repeat_interleave(x, 2),
    "to(dtype)": lambda: x.to(torch.int32),
    "to(same host device) on the host": lambda: x.to("cpu"),
    "copy_": lambda: torch.zeros(6, dtype=torch.int64).copy_(x),
    "torch.tensor(tensor)": lambda: torch.as_tensor(x),
    "shape/size/numel": lambda: (x.shape[0], x.size(0), x.numel(), x.dim()),
    "einsum (python-level torch function)": lambda: torch.einsum("i,i->", x.float(), x.float()),
    "clamp/gather": lambda: torch.gather(x, 0, torch.full((2,), 1)).clamp_min(0),
}


@pytest.mark.parametrize("op", list(FLAGGED))
def test_flags_host_reads(op):
    with pytest.raises(HostSyncError) as info:
        with SyncDetector("replay metadata"):
            FLAGGED[op]()
    message = str(info.value)
    assert message.startswith(RULE)
    assert "no host-device sync in graph-replay metadata" in message
    assert "in replay metadata" in message
    name = op.split(" ")[0].split("(")[0]
    if name.startswith(("Tensor.", "torch.")):
        assert name in message, message


@pytest.mark.parametrize("op", list(ALLOWED))
def test_allows_device_side_ops(op):
    with SyncDetector("replay metadata") as detector:
        ALLOWED[op]()
    assert detector.violations == []


def test_message_names_the_caller():
    def my_metadata():
        return x.sum().item()

    with pytest.raises(
        HostSyncError, match=r"Tensor\.item\(\) in my method at test_conformance_sync_detector\.py:\d+ \(my_metadata\)"
    ):
        with SyncDetector("my method"):
            my_metadata()


def test_records_without_raising_and_catches_swallowed_errors():
    detector = SyncDetector("metadata", raise_on_violation=False)
    with detector:
        x.tolist()
        int(x[0])
    assert len(detector.violations) == 2 and "Tensor.tolist" in detector.violations[0]

    detector = SyncDetector("metadata")
    with detector:
        try:
            x[0].item()
        except HostSyncError:
            pass  # a backend that swallows the error is still caught by the record
    assert detector.violations and "Tensor.item" in detector.violations[0]


def test_to_host_is_flagged_when_the_device_under_test_is_not_the_host():
    # On an accelerator run, .to("cpu") of a device tensor is a sync; the detector decides from
    # the device under test, so the rule is also enforced by a host run that mimics one.
    with pytest.raises(HostSyncError, match=r"Tensor\.to\(\).*copies a tensor to the host"):
        with SyncDetector("metadata", device="meta"):
            x.to("cpu")
    with pytest.raises(HostSyncError):
        with SyncDetector("metadata", device="meta"):
            x.to(device=torch.device("cpu"))


def test_inactive_outside_the_block():
    with SyncDetector("metadata"):
        pass
    assert x[0].item() == 0  # no mode left behind


# Data-dependent sizes: torch converts the tensor to a Python number in C++ argument parsing,
# which only the dispatcher-level layer sees (as aten._local_scalar_dense) or the op itself.
DATA_DEPENDENT = {
    "arange(t.max())": (lambda: torch.arange(x.max()), "aten._local_scalar_dense"),
    "zeros(t.max())": (lambda: torch.zeros(x.max()), "aten._local_scalar_dense"),
    "full((t.max(),), v)": (lambda: torch.full((x.max(),), 1), "aten._local_scalar_dense"),
    "empty(t[0])": (lambda: torch.empty(x[3]), "aten._local_scalar_dense"),
    "slice with a tensor bound": (lambda: x[: x.max()], "aten._local_scalar_dense"),
    "narrow with a tensor length": (lambda: x.narrow(0, 0, x[2]), "aten._local_scalar_dense"),
    "bincount": (lambda: torch.bincount(x), "aten.bincount"),
    "bincount with minlength": (lambda: torch.bincount(x, minlength=8), "aten.bincount"),
    "unique_consecutive": (lambda: torch.unique_consecutive(x), "unique_consecutive"),
}


@pytest.mark.parametrize("op", list(DATA_DEPENDENT))
def test_flags_data_dependent_sizes(op):
    fn, needle = DATA_DEPENDENT[op]
    with pytest.raises(HostSyncError) as info:
        with SyncDetector("replay metadata"):
            fn()
    assert str(info.value).startswith(RULE) and needle in str(info.value), str(info.value)


@pytest.mark.parametrize("op", ["arange(t.max())", "bincount with minlength", "slice with a tensor bound"])
def test_function_layer_alone_misses_them(op):
    """Why the dispatcher layer exists: without it these pass unnoticed."""
    with SyncDetector("replay metadata", dispatch=False) as detector:
        DATA_DEPENDENT[op][0]()
    assert detector.violations == []


def test_dispatch_layer_sees_device_to_host_copies():
    from attnplug_conformance.sync_detector import dispatch_offence

    meta = torch.empty(3, device="meta")
    assert dispatch_offence(torch.ops.aten._to_copy.default, (meta,), {"device": torch.device("cpu")})
    assert dispatch_offence(torch.ops.aten.copy_.default, (torch.empty(3), meta), {})
    assert dispatch_offence(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.int32}) is None


def test_one_violation_is_reported_once():
    detector = SyncDetector("metadata", raise_on_violation=False)
    with detector:
        int(x[0])  # Tensor.__int__ and, below it, aten._local_scalar_dense: one violation
    assert len(detector.violations) == 1
