"""docs/capabilities.md is generated from the declared capabilities (stale -> this fails), and
``attnplug info`` starts no device runtime and builds nothing."""

from __future__ import annotations

import pytest
import torch

from attnplug import cli
from attnplug.capabilities_doc import capabilities_markdown
from plugin_dists import ROOT

DOC = ROOT / "docs" / "capabilities.md"


def test_capabilities_doc_is_up_to_date(project_registry):
    want = capabilities_markdown(project_registry)
    assert DOC.read_text() == want, (
        "docs/capabilities.md is stale: regenerate it with `attnplug info --markdown docs/capabilities.md`"
    )


def test_the_doc_rows_are_the_declared_capabilities(project_registry):
    text = capabilities_markdown(project_registry)
    rows = {
        line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[2:-1]]
        for line in text.splitlines()
        if line.startswith("| `")
    }
    assert set(rows) == {"reference", "cuda", "ascend", "xpu"}
    for name, cells in rows.items():
        cls, _ = project_registry.resolve(name)
        caps = cls.declared_capabilities()
        assert cells[1] == caps.device_type and cells[4].startswith(caps.graphs.name), name
        assert cells[3] == ("where supported" if caps.pdl else "no"), name


def test_markdown_option_writes_the_file(project_registry, tmp_path, capsys):
    out = tmp_path / "caps.md"
    assert cli.main(["info", "--markdown", str(out)]) == 0
    assert out.read_text() == capabilities_markdown(project_registry)
    assert cli.main(["info", "--markdown"]) == 0
    assert capsys.readouterr().out.endswith(out.read_text())
    assert cli.main(["info", "--markdown", str(tmp_path / "missing" / "x.md")]) == 2
    assert "attnplug: error: info: --markdown" in capsys.readouterr().err


def test_info_starts_no_device_runtime_and_builds_nothing(project_registry, monkeypatch):
    """The cuda probe made to pass on this machine, the C++ KV store asked for: ``info`` must
    still create no CUDA context, query no device property and build or load nothing."""
    pytest.importorskip("triton")
    import torch.utils.cpp_extension as cpp_extension

    from attnplug_cuda import cpp_ext

    forbidden = []

    def refuse(what):
        def call(*args, **kwargs):
            forbidden.append(what)
            raise AssertionError(f"attnplug info called {what}")

        return call

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in (
        "_lazy_init",
        "init",
        "current_device",
        "get_device_capability",
        "get_device_properties",
        "synchronize",
    ):
        monkeypatch.setattr(torch.cuda, name, refuse(f"torch.cuda.{name}"))
    monkeypatch.setattr(cpp_extension, "load", refuse("torch.utils.cpp_extension.load"))
    monkeypatch.setattr(cpp_ext, "load_ext", refuse("cpp_ext.load_ext"))
    monkeypatch.setenv("ATTNPLUG_KV_STORE", "cpp")
    data = cli.info_data(project_registry)
    rows = {row["name"]: row for row in data["backends"]}
    cuda = rows["cuda"]
    assert cuda["available"] is True, cuda["reason"]
    assert cuda["capabilities"]["graphs"] == "ALWAYS" and cuda["capabilities"]["pdl"] == "run time"
    assert "kv_store" in cuda["capabilities"] and "describe() raised" not in cuda["reason"]
    assert forbidden == []


def test_info_shows_what_an_instance_would_report(project_registry):
    """For the backend available here, the info row and an instance's capabilities agree."""
    data = cli.info_data(project_registry)
    ref = {row["name"]: row for row in data["backends"]}["reference"]
    from attnplug import ReqToTokenPool, SWAKVPool
    from attnplug.backends.reference import ReferenceBackend

    pool = SWAKVPool(64, 32, 2, [0], 2, 16, torch.float32, torch.device("cpu"))
    caps = (
        ReferenceBackend(pool, ReqToTokenPool(4, 32, torch.device("cpu")), num_heads=2, sliding_window=4)
        .capabilities()
        .to_json()
    )
    shown = ref["capabilities"]
    assert {k: shown[k] for k in caps if k != "device_type"} == {k: v for k, v in caps.items() if k != "device_type"}
    assert (ref["pdl"], ref["graphs"]) == (caps["pdl"], caps["graphs"])
