"""The plugin-fault matrix (tests/fault_matrix.py) run in this process through
``attnplug.cli.main``: every scenario that cannot hang or end the process on a regression.
The others, and every fault at once through the ``attnplug info`` command, are in
test_plugin_faults_subprocess.py."""

from __future__ import annotations

import json

import pytest

from attnplug import cli
from attnplug import registry as R
from attnplug.backends.reference import ReferenceBackend
from fault_matrix import FAULTS, assert_outcome, env_for, install

pytestmark = pytest.mark.usefixtures("clean_registry")


def test_the_matrix_is_large_enough():
    assert len(FAULTS) >= 30
    assert sum(f.hangs for f in FAULTS.values()) >= 5


@pytest.mark.parametrize("name", sorted(n for n, f in FAULTS.items() if not f.hangs))
def test_fault_in_process(name, tmp_path, monkeypatch, capsys):
    fault = FAULTS[name]
    for path in reversed(install(fault, tmp_path)):
        monkeypatch.syspath_prepend(path)
    for key, value in env_for(fault).items():
        monkeypatch.setenv(key, value)
    R.reset_registry()
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert_outcome(name, fault, data)
    if fault.reference_disabled:
        with pytest.raises(R.BackendUnavailable, match="not in ATTNPLUG_PLUGINS"):
            R.get_backend("reference")
    else:
        assert R.get_backend("reference") is ReferenceBackend
    if fault.check is not None:
        fault.check(data)
