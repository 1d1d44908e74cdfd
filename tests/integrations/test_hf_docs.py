"""docs/models.md's architectures x backends table is what the backends declare (stale ->
this fails), and the table says "no" with the reason for a backend lacking a capability."""

import dataclasses

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug.integrations.transformers.support import (  # noqa: E402
    TABLE_BEGIN,
    TABLE_END,
    architecture_features,
    support_table_markdown,
)
from plugin_dists import ROOT  # noqa: E402

DOC = ROOT / "docs" / "models.md"


def test_the_support_table_in_the_docs_is_up_to_date(project_registry):
    text = DOC.read_text()
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    assert text[start:end] + "\n" == support_table_markdown(registry=project_registry), (
        "docs/models.md's support table is stale: regenerate it with "
        "`python -m attnplug.integrations.transformers.support docs/models.md`"
    )


def test_a_backend_lacking_sinks_and_softcap_cannot_run_gemma2_and_gpt_oss():
    caps = dataclasses.replace(ReferenceBackend.declared_capabilities(), logit_softcap=False, attention_sinks=False)
    table = support_table_markdown(
        architecture_features(), {"reference": ReferenceBackend.declared_capabilities(), "plain": caps}
    )
    rows = {
        line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[3:-1]]
        for line in table.splitlines()
        if line.startswith("| `")
    }
    assert rows["gemma2"] == ["no: attention logit soft-capping 1.0", "yes"]
    assert rows["gpt_oss"] == ["no: attention sinks", "yes"]
    assert rows["gemma3_text"] == ["yes", "yes"]
