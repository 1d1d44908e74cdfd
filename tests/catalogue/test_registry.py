"""Catalogue: adversarial plugins against the registry (Trust II, issue 37, "Registry and
plugins").

Each case installs one misbehaving plugin distribution (``zz-evil 6.6``, entry point ``evil``)
next to a well-behaved one (``good``, the higher priority) and checks that

* the verdict names the plugin or backend and what its code did: raised, returned something of
  the wrong type, timed out (``$ATTNPLUG_PROBE_TIMEOUT``, 0.5 s here), ended the probe process
  (exit code or signal), left a non-daemon thread running, changed the process state;
* the caller survives and its state is as before (``os.environ``, torch's default dtype, torch's
  and Python's random state, no thread left behind): the ``caller`` fixture checks it after
  every case; a case that must not take long says so;
* the good backend is still selected.

Topics: probes (``os._exit``, a signal, a segfault, a hang, a busy loop, ``sys.exit``, a
non-daemon thread, changes to ``os.environ`` / default dtype / random states, output on the
protocol pipe, an unreadable result); plugin imports, ``PLUGIN_API_VERSION`` reads and hooks that
hang or change the process (these run in-process, in a guarded thread under the time limit); the
backend class import (tried in the probe process first: hangs, exits, threads); ``describe()``
(hangs, exits, threads, changes); capabilities of the wrong type (``describe()`` and
``declared_capabilities()`` returning ``None``, a dict, a string, a ``Capabilities`` with
wrong-typed fields; ``needs_cpu_seq_lens`` not a bool); ``attnplug info`` showing malformed
``ATTNPLUG_*`` values as errors, ``ATTNPLUG_PLUGINS``-filtered plugins as disabled (not
errors) and what plugin code did; and the ``attnplug info`` command itself surviving plugins that
end, hang or keep alive the process that probes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import rich.console  # noqa: F401 - imported before any case: importing rich draws from Python's random
import rich.table  # noqa: F401
import torch

from attnplug import cli
from attnplug import registry as R
from attnplug.registry import BackendUnavailable
from child import HANG_LIMIT_S
from plugin_dists import (
    PROJECT_PATHS,
    DistTree,
    StandInBackend,
    one_error,
    plugin_source,
    reg,
    run_cli,
    subprocess_env,
    write_project_metadata,
)

#: ATTNPLUG_PROBE_TIMEOUT of every case
LIMIT = "0.5"
HERE = Path(__file__).resolve().parents[1]  # tests/: plugin_dists


class CallerState:
    """What the caller's process must still look like after a case."""

    def __init__(self) -> None:
        self.environ = self._environ()
        self.dtype = torch.get_default_dtype()
        self.rng = torch.random.get_rng_state()
        self.random = random.getstate()
        self.threads = set(threading.enumerate())  # a new non-daemon thread would keep the process alive

    @staticmethod
    def _environ():
        return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}

    def check(self) -> None:
        assert self._environ() == self.environ, "the caller's os.environ changed"
        assert torch.get_default_dtype() == self.dtype, "the caller's default dtype changed"
        assert torch.equal(torch.random.get_rng_state(), self.rng), "the caller's torch random state changed"
        assert random.getstate() == self.random, "the caller's Python random state changed"
        left = [t.name for t in threading.enumerate() if t not in self.threads and not t.daemon]
        assert left == [], f"non-daemon threads left running in the caller: {left}"


@pytest.fixture
def caller(monkeypatch):
    for name in [n for n in os.environ if n.startswith("ATTNPLUG_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", LIMIT)
    state = CallerState()
    yield state
    R.reset_registry()
    state.check()


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return DistTree(tmp_path / "site")


GOOD = plugin_source([reg("good", priority=10)])


def install(tree: DistTree, evil: str, modules=None):
    """The good plugin and ``evil`` (plugin ``evil`` of ``zz-evil 6.6``), plus ``modules``
    (name -> source) next to them; returns the registry over them."""
    for name, text in (modules or {}).items():
        (tree.root / f"{name}.py").write_text(textwrap.dedent(text))
    tree.add("good-dist", {"good": GOOD})
    tree.add("zz-evil", {"evil": evil}, version="6.6")
    return tree.load()


def backend(body: str, *, target: str = "'plugin_dists:StandInBackend'", priority: int = -5) -> str:
    """Plugin ``evil`` registering backend ``evil`` whose probe is ``probe`` of ``body``."""
    return plugin_source([f"name='evil', backend={target}, probe=probe, priority={priority}"], body=body)


def info_of(registry, name: str):
    return {i.name: i for i in registry.available_backends()}[name]


def assert_good_still_wins(registry):
    assert registry.get_backend() is StandInBackend
    assert registry.select()[0] == "good"


def unavailable(registry, name: str = "evil") -> str:
    with pytest.raises(BackendUnavailable) as exc:
        registry.get_backend(name)
    message = str(exc.value)
    assert f"backend {name!r}" in message
    return message


# ---------------------------------------------------------------------------- probes
FINE = "    return True, 'fine'"
PROBES = {
    # case: (probe body, text the reason must hold)
    "probe-os-exit": ("import os\ndef probe():\n    os._exit(3)", "probe exited the process with code 3"),
    "probe-os-exit-after-output": (
        "import os, sys\ndef probe():\n    sys.stderr.write('goodbye from the probe\\n'); sys.stderr.flush()\n"
        "    os._exit(7)",
        "probe exited the process with code 7 (its last output: 'goodbye from the probe')",
    ),
    "probe-kills-its-process": (
        "import os, signal\ndef probe():\n    os.kill(os.getpid(), signal.SIGKILL)",
        "probe killed the process with signal SIGKILL",
    ),
    "probe-segfaults": (
        "import ctypes\ndef probe():\n    ctypes.string_at(0)",
        "probe killed the process with signal SIGSEGV (its last output: 'Fatal Python error: Segmentation fault",
    ),
    "probe-hangs": (
        "import time\ndef probe():\n    time.sleep(3600)",
        "probe timed out after 0.5 s; its process was killed",
    ),
    "probe-busy-loop": (
        "def probe():\n    while True:\n        pass",
        "probe timed out after 0.5 s; its process was killed",
    ),
    "probe-non-daemon-thread": (
        "import threading, time\ndef probe():\n"
        "    threading.Thread(target=time.sleep, args=(3600,), name='evil-worker', daemon=False).start()\n" + FINE,
        "probe left a non-daemon thread running ('evil-worker'); a probe must not leave threads behind",
    ),
    "probe-result-unreadable": (
        "class Weird(tuple):\n    def __len__(self):\n        raise SystemExit('len exits')\n"
        "def probe():\n    return Weird((True, 'x'))",
        "reading what the probe returned raised SystemExit: len exits",
    ),
    "probe-sys-exit": ("import sys\ndef probe():\n    sys.exit(2)", "probe raised SystemExit: 2"),
}


@pytest.mark.parametrize("case", sorted(PROBES))
def test_a_probe_that_misbehaves_only_makes_its_backend_unavailable(case, tree, caller):
    body, text = PROBES[case]
    registry = install(tree, backend(body))
    t0 = time.monotonic()
    infos = {i.name: i for i in registry.available_backends()}
    assert time.monotonic() - t0 < 15
    assert not infos["evil"].available and text in infos["evil"].reason, infos["evil"].reason
    assert infos["good"].available
    assert text in unavailable(registry)
    assert_good_still_wins(registry)


NOTES = {
    # case: (statements the probe runs before returning (True, 'fine'), the note)
    "probe-sets-ATTNPLUG_BACKEND": (
        "os.environ['ATTNPLUG_BACKEND'] = 'evil'; os.environ['ATTNPLUG_VALIDATE'] = '1'",
        "the probe changed os.environ ATTNPLUG_BACKEND, ATTNPLUG_VALIDATE (ignored)",
    ),
    "probe-removes-a-variable": (
        "del os.environ['CATALOGUE_MARK']",
        "the probe changed os.environ CATALOGUE_MARK (ignored)",
    ),
    "probe-sets-the-default-dtype": (
        "torch.set_default_dtype(torch.float64)",
        "the probe changed torch's default dtype to torch.float64 (ignored)",
    ),
    "probe-seeds-torch": ("torch.manual_seed(1234)", "the probe changed the state of torch's random number generator"),
    "probe-draws-from-python-random": ("random.random()", "the probe changed the state of Python's random module"),
}


@pytest.mark.parametrize("case", sorted(NOTES))
def test_a_probe_that_changes_the_process_changes_only_its_own(case, tree, caller, monkeypatch):
    statements, note = NOTES[case]
    monkeypatch.setenv("CATALOGUE_MARK", "kept")
    caller.environ["CATALOGUE_MARK"] = "kept"
    body = f"import os, random, torch\ndef probe():\n    {statements}\n" + FINE
    registry = install(tree, backend(body))
    info = info_of(registry, "evil")
    assert info.available and info.reason == "fine"
    assert any(note in n for n in info.notes), info.notes
    (recorded,) = [n for n in registry.notes() if n.backend == "evil"]
    assert recorded.plugin == "evil" and recorded.distribution == "zz-evil" and note in recorded.note
    assert_good_still_wins(registry)  # a low-priority probe that sets ATTNPLUG_BACKEND is not the default


def test_a_probe_that_writes_to_stdout_corrupts_nothing(tree, caller, capfd):
    body = "import os\ndef probe():\n    print('{\"id\": 1, \"done\": {}}'); os.write(1, b'garbage\\n')\n" + FINE
    registry = install(tree, backend(body))
    assert info_of(registry, "evil").reason == "fine"
    out, _ = capfd.readouterr()
    assert "garbage" not in out and '"done"' not in out  # not the caller's output, not the protocol


# ---------------------------------------------------------------------------- loading: import, version, hook
LOADING = {
    # case: (plugin source, kind, text)
    "import-hangs": (
        plugin_source([reg("evil")], body="import time\ntime.sleep(60)"),
        "import",
        "timed out after 0.5 s",
    ),
    "hook-hangs": (
        plugin_source([reg("evil")], then=["__import__('time').sleep(60)"]),
        "hook",
        "attnplug_register_backends timed out after 0.5 s",
    ),
    "api-version-read-hangs": (
        plugin_source(
            [reg("evil")],
            api=None,
            body="def __getattr__(name):\n    __import__('time').sleep(60)",
        ),
        "api-version",
        "reading PLUGIN_API_VERSION timed out after 0.5 s",
    ),
}


@pytest.mark.parametrize("case", sorted(LOADING))
def test_a_plugin_that_hangs_while_loading_is_reported_within_the_limit(case, tree, caller):
    source, kind, text = LOADING[case]
    t0 = time.monotonic()
    registry = install(tree, source)
    assert time.monotonic() - t0 < 5
    error = one_error(registry, "evil")
    assert error.kind == kind and text in error.reason, error
    assert "plugin 'evil' (zz-evil 6.6" in unavailable(registry)
    assert_good_still_wins(registry)


LOAD_NOTES = {
    "import-sets-ATTNPLUG_BACKEND": (
        plugin_source([reg("evil", priority=-5)], body="import os\nos.environ['ATTNPLUG_BACKEND'] = 'evil'"),
        "importing it changed os.environ ATTNPLUG_BACKEND (undone)",
    ),
    "hook-sets-the-default-dtype": (
        plugin_source(
            [reg("evil", priority=-5)], then=["__import__('torch').set_default_dtype(__import__('torch').float64)"]
        ),
        "its attnplug_register_backends hook changed torch's default dtype to torch.float64 (undone)",
    ),
    "import-leaves-a-non-daemon-thread": (
        plugin_source(
            [reg("evil", priority=-5)],
            body="import threading\nSTOP = threading.Event()\n"
            "threading.Thread(target=STOP.wait, args=(30,), name='evil-import-thread', daemon=False).start()",
        ),
        "importing it left a non-daemon thread running ('evil-import-thread')",
    ),
}


@pytest.mark.parametrize("case", sorted(LOAD_NOTES))
def test_what_a_plugin_import_or_hook_changes_is_undone_and_said(case, tree, caller):
    source, note = LOAD_NOTES[case]
    registry = install(tree, source)
    try:
        notes = [n for n in registry.notes() if n.backend is None]
        assert [(n.plugin, n.distribution) for n in notes] == [("evil", "zz-evil")], notes
        assert note in notes[0].note, notes
        assert_good_still_wins(registry)
    finally:
        module = sys.modules.get(registry.records[-1].entry_point) if registry.records else None
        if module is not None and hasattr(module, "STOP"):
            module.STOP.set()  # the one thing in-process code can leave behind: stop it for the next case
            time.sleep(0.1)


# ---------------------------------------------------------------------------- the backend class import
CLASS_IMPORTS = {
    # case: (the backend module's source, text in the reason)
    "class-import-hangs": (
        "import time\ntime.sleep(3600)",
        "its import timed out after 0.5 s in the probe process (killed); it is not imported here",
    ),
    "class-import-exits": ("import os\nos._exit(4)", "its import exited the process with code 4"),
    "class-import-leaves-a-thread": (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), name='evil-class-thread', "
        "daemon=False).start()\nfrom plugin_dists import StandInBackend as Backend",
        "its import left a non-daemon thread running ('evil-class-thread') in the probe process",
    ),
}


@pytest.mark.parametrize("case", sorted(CLASS_IMPORTS))
def test_a_backend_class_whose_import_misbehaves_is_never_imported_by_the_caller(case, tree, caller):
    module_source, text = CLASS_IMPORTS[case]
    module = f"evil_backend_{case.replace('-', '_')}_{os.getpid()}_{time.monotonic_ns()}"
    registry = install(
        tree, backend("def probe():\n" + FINE, target=repr(f"{module}:Backend")), {module: module_source}
    )
    info = info_of(registry, "evil")
    assert not info.available and text in info.reason and f"{module}:Backend" in info.reason, info.reason
    assert module not in sys.modules
    assert text in unavailable(registry)
    assert_good_still_wins(registry)


def test_a_backend_class_import_that_changes_the_environment_is_undone(tree, caller):
    module = f"evil_backend_env_{os.getpid()}_{time.monotonic_ns()}"
    source = "import os\nos.environ['ATTNPLUG_DISABLE_PDL'] = '1'\nfrom plugin_dists import StandInBackend as Backend"
    registry = install(tree, backend("def probe():\n" + FINE, target=repr(f"{module}:Backend")), {module: source})
    info = info_of(registry, "evil")
    assert info.available
    assert f"importing '{module}:Backend' changed os.environ ATTNPLUG_DISABLE_PDL (undone)" in info.notes
    assert "ATTNPLUG_DISABLE_PDL" not in os.environ


# ---------------------------------------------------------------------------- describe()
DESCRIBES = {
    # case: (describe()'s body, text in the reason)
    "describe-hangs": (
        "import time; time.sleep(3600)",
        "Evil.describe() timed out after 0.5 s; its process was killed",
    ),
    "describe-exits": ("import os; os._exit(5)", "Evil.describe() exited the process with code 5"),
    "describe-leaves-a-thread": (
        "import threading, time; threading.Thread(target=time.sleep, args=(3600,), name='evil-describe', "
        "daemon=False).start(); return {}",
        "Evil.describe() left a non-daemon thread running ('evil-describe')",
    ),
}

_EVIL_CLASS = """
from plugin_dists import StandInBackend
class Evil(StandInBackend):
    @classmethod
    def describe(cls):
        {body}
"""


@pytest.mark.parametrize("case", sorted(DESCRIBES))
def test_a_describe_that_misbehaves_leaves_its_backend_listed_with_the_problem(case, tree, caller):
    body, text = DESCRIBES[case]
    module = f"evil_describe_{case.replace('-', '_')}_{os.getpid()}_{time.monotonic_ns()}"
    registry = install(
        tree, backend("def probe():\n" + FINE, target=repr(f"{module}:Evil")), {module: _EVIL_CLASS.format(body=body)}
    )
    info = info_of(registry, "evil")
    assert info.available and text in info.reason, info.reason
    assert registry.get_backend("evil").__name__ == "Evil"


def test_a_describe_that_changes_the_environment_changes_only_its_own(tree, caller):
    module = f"evil_describe_env_{os.getpid()}_{time.monotonic_ns()}"
    body = "import os; os.environ['ATTNPLUG_BACKEND'] = 'evil'; return {}"
    registry = install(
        tree, backend("def probe():\n" + FINE, target=repr(f"{module}:Evil")), {module: _EVIL_CLASS.format(body=body)}
    )
    info = info_of(registry, "evil")
    assert info.available and "Evil.describe() changed os.environ ATTNPLUG_BACKEND (ignored)" in info.notes
    assert_good_still_wins(registry)


# ---------------------------------------------------------------------------- capabilities of the wrong type
_CAPS_CLASS = """
import torch
from attnplug import Capabilities, GraphSupport
from plugin_dists import StandInBackend
def caps(**wrong):
    fields = dict(device_type="cpu", needs_cpu_seq_lens=False, pdl=False, graphs=GraphSupport.NEVER,
                  dtypes=(torch.float16,), head_dims=(64,), page_sizes=(1,), sliding_window=True)
    fields.update(wrong)
    return Capabilities(**fields)
class Evil(StandInBackend):
    {body}
"""
_DECLARED = "@classmethod\n    def declared_capabilities(cls):\n        return {}"
_DESCRIBE = "@classmethod\n    def describe(cls):\n        return {}"

CAPABILITIES = {
    # case: (the class body, text in the problem)
    "describe-returns-None": (_DESCRIBE.format("None"), "describe() returned None (a NoneType); expected a dict"),
    "describe-returns-a-string": (_DESCRIBE.format("'fast'"), "describe() returned 'fast' (a str); expected a dict"),
    "describe-returns-a-list": (_DESCRIBE.format("[1, 2]"), "describe() returned [1, 2] (a list); expected a dict"),
    "declared-capabilities-a-dict": (
        _DECLARED.format("{'pdl': True}"),
        "declared_capabilities() returned {'pdl': True} (a dict); expected an attnplug.Capabilities or None",
    ),
    "declared-capabilities-a-string": (
        _DECLARED.format("'everything'"),
        "declared_capabilities() returned 'everything' (a str); expected an attnplug.Capabilities or None",
    ),
    "capabilities-graphs-a-string": (
        _DECLARED.format("caps(graphs='UNIFORM')"),
        "graphs='UNIFORM' (a str), expected a GraphSupport",
    ),
    "capabilities-dtypes-None": (_DECLARED.format("caps(dtypes=None)"), "dtypes=None (a NoneType), expected a tuple"),
    "capabilities-dtypes-strings": (
        _DECLARED.format("caps(dtypes=('float16',))"),
        "dtypes=('float16',) (a tuple), expected a tuple of torch dtypes",
    ),
    "capabilities-head-dims-a-list": (
        _DECLARED.format("caps(head_dims=[64])"),
        "head_dims=[64] (a list), expected a tuple of positive ints",
    ),
    "capabilities-page-sizes-bools": (
        _DECLARED.format("caps(page_sizes=(True,))"),
        "page_sizes=(True,) (a tuple), expected a tuple of positive ints",
    ),
    "capabilities-pdl-a-string": (_DECLARED.format("caps(pdl='yes')"), "pdl='yes' (a str), expected True or False"),
    "needs-cpu-seq-lens-a-string": (
        "needs_cpu_seq_lens = 'no'",
        "needs_cpu_seq_lens is 'no' (a str); expected True or False",
    ),
}


@pytest.mark.parametrize("case", sorted(CAPABILITIES))
def test_capabilities_of_the_wrong_type_get_a_message_naming_the_plugin(case, tree, caller):
    body, text = CAPABILITIES[case]
    module = f"evil_caps_{case.replace('-', '_')}_{os.getpid()}_{time.monotonic_ns()}"
    registry = install(
        tree, backend("def probe():\n" + FINE, target=repr(f"{module}:Evil")), {module: _CAPS_CLASS.format(body=body)}
    )
    info = info_of(registry, "evil")
    assert text in info.reason, info.reason
    assert "Evil (backend 'evil' of plugin 'evil' (zz-evil 6.6))" in info.reason, info.reason
    assert not info.capabilities
    assert_good_still_wins(registry)


# ---------------------------------------------------------------------------- attnplug info
@pytest.mark.parametrize(
    "name, value, text",
    [
        ("ATTNPLUG_VALIDATE", "ture", "ATTNPLUG_VALIDATE='ture': expected a switch: 1, true, yes, on"),
        ("ATTNPLUG_DISABLE_PDL", "maybe", "ATTNPLUG_DISABLE_PDL='maybe': expected a switch"),
        ("ATTNPLUG_VLLM_SLOTS", "CPU ATTN!", "ATTNPLUG_VLLM_SLOTS='CPU ATTN!': expected comma-separated vLLM backend"),
    ],
)
def test_info_shows_a_malformed_variable_as_an_error(name, value, text, tree, caller, monkeypatch, capsys):
    R.reset_registry(install(tree, GOOD.replace("'good'", "'other'")))
    monkeypatch.setenv(name, value)
    caller.environ[name] = value
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert text in data["environment_errors"][name]
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"environment error: {text}" in out
    assert f"environment: {name}" not in out  # not shown as if fine


def test_info_shows_plugins_left_out_by_ATTNPLUG_PLUGINS_as_disabled_not_errors(tree, caller, monkeypatch, capsys):
    monkeypatch.setenv("ATTNPLUG_PLUGINS", "good")
    caller.environ["ATTNPLUG_PLUGINS"] = "good"
    R.reset_registry(install(tree, plugin_source([reg("evil")])))
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["errors"] == []
    assert [(e["plugin"], e["distribution"]) for e in data["disabled"]] == [("evil", "zz-evil")]
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "not loaded, as ATTNPLUG_PLUGINS=good asks: evil (zz-evil 6.6)" in out and "no plugin load errors" in out


def test_info_says_what_plugin_code_did(tree, caller, capsys):
    source = plugin_source(
        ["name='evil', backend='plugin_dists:StandInBackend', probe=probe, priority=-5"],
        body="import os\nos.environ['CATALOGUE_IMPORT'] = '1'\n"
        "def probe():\n    os.environ['ATTNPLUG_BACKEND'] = 'evil'\n    return True, 'fine'",
    )
    R.reset_registry(install(tree, source))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "note: the probe changed os.environ ATTNPLUG_BACKEND (ignored)" in out
    assert "evil (zz-evil 6.6): importing it changed os.environ CATALOGUE_IMPORT (undone)" in out
    assert "default: get_backend() returns 'good'" in out


# ---------------------------------------------------------------------------- the attnplug info command
COMMAND_PLUGINS = {
    "exits": backend("import os\ndef probe():\n    os._exit(3)").replace("'evil'", "'exits'"),
    "thread": backend(
        "import threading, time\ndef probe():\n"
        "    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()\n" + FINE
    ).replace("'evil'", "'thread'"),
    "hangs": backend("import time\ndef probe():\n    time.sleep(3600)").replace("'evil'", "'hangs'"),
    "steers": backend("import os\ndef probe():\n    os.environ['ATTNPLUG_BACKEND'] = 'steers'\n" + FINE).replace(
        "'evil'", "'steers'"
    ),
    "slow-import": plugin_source([reg("slow-import")], body="import time\ntime.sleep(3600)"),
}


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    """``attnplug info --json`` as a user runs it, with every plugin of ``COMMAND_PLUGINS``
    installed next to the project's own."""
    tmp = tmp_path_factory.mktemp("info_command")
    site = tmp / "site"
    write_project_metadata(site)
    tree = DistTree(site)
    for name, source in COMMAND_PLUGINS.items():
        tree.add(f"evil-{name}", {name: source}, version="6.6")
    env = subprocess_env(site, HERE, *PROJECT_PATHS)
    env["ATTNPLUG_PROBE_TIMEOUT"] = LIMIT
    t0 = time.monotonic()
    out = run_cli(env, "info", "--json", cwd=tmp, timeout=HANG_LIMIT_S)
    return out, time.monotonic() - t0


@pytest.mark.parametrize(
    "name, text",
    [
        ("exits", "probe exited the process with code 3"),
        ("thread", "probe left a non-daemon thread running"),
        ("hangs", "probe timed out after 0.5 s; its process was killed"),
    ],
)
@pytest.mark.slow
def test_the_info_command_survives_a_probe_that_ends_keeps_or_hangs_its_process(name, text, command, caller):
    out, _took = command
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {row["name"]: row for row in json.loads(out.stdout)["backends"]}
    assert not rows[name]["available"] and text in rows[name]["reason"], rows[name]


@pytest.mark.slow
def test_the_info_command_reports_a_hung_plugin_import_by_name(command, caller):
    out, took = command
    assert out.returncode == 0, out.stderr[-2000:]
    (error,) = [e for e in json.loads(out.stdout)["errors"] if e["plugin"] == "slow-import"]
    assert error["kind"] == "import" and "timed out after 0.5 s" in error["reason"]
    assert error["distribution"] == "evil-slow-import"
    assert took < 90


@pytest.mark.slow
def test_the_info_command_default_is_not_steered_by_a_probe(command, caller):
    out, _took = command
    data = json.loads(out.stdout)
    rows = [row for row in data["backends"] if row["available"]]
    best = max(rows, key=lambda row: row["priority"])["name"]  # reference here, cuda on a GPU
    assert data["default_backend"] == best != "steers", data["default_error"]
    steers = {row["name"]: row for row in data["backends"]}["steers"]
    assert steers["available"] and "the probe changed os.environ ATTNPLUG_BACKEND (ignored)" in steers["notes"]


def test_info_checks_the_variables_a_plugin_declares():
    """The cuda plugin's own ATTNPLUG_KV_STORE: a fresh `attnplug info` loads the plugin module,
    which declares the variable and its reader, so a malformed value is an error there too
    (it was shown as if fine: only core's variables were checked)."""
    pytest.importorskip("attnplug_cuda")
    env = {**os.environ, "ATTNPLUG_KV_STORE": "bogus"}
    proc = subprocess.run(
        [sys.executable, "-m", "attnplug.cli", "info", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
    )
    data = json.loads(proc.stdout)
    assert "ATTNPLUG_KV_STORE='bogus': expected 'triton' or 'cpp'" in data["environment_errors"]["ATTNPLUG_KV_STORE"]
