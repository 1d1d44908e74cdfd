"""``attnplug.env``: every ``ATTNPLUG_*`` variable parsed through a declared flag, errors naming
the variable; no module but an ``env`` module reads one, and every one is declared (core's, or a
plugin's: ``attnplug_cuda.env``) and documented."""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest

from attnplug import env
from attnplug_cuda import env as cuda_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE_TREES = ("core", "plugins", "conformance", "benchmarks", "examples")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in env.FLAGS:
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------- defaults
def test_defaults_when_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert env.backend_name() is None
    assert env.plugin_allow_list() is None
    assert env.probe_timeout() == env.DEFAULT_PROBE_TIMEOUT == 5.0
    assert env.validation_enabled() is False and env.pdl_disabled() is False
    assert cuda_env.cpp_disabled() is False and cuda_env.cpp_verbose() is False
    assert cuda_env.kv_store_kernel() == "triton"
    assert cuda_env.cache_dir() == tmp_path / "attnplug"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cuda_env.cache_dir() == pathlib.Path.home() / ".cache" / "attnplug"
    assert env.flags_set() == {}


def test_blank_means_unset(monkeypatch):
    for name in env.FLAGS:
        monkeypatch.setenv(name, "  ")
    assert env.backend_name() is None and env.plugin_allow_list() is None
    assert env.probe_timeout() == env.DEFAULT_PROBE_TIMEOUT and cuda_env.kv_store_kernel() == "triton"
    assert not (env.validation_enabled() or env.pdl_disabled() or cuda_env.cpp_disabled() or cuda_env.cpp_verbose())
    assert env.flags_set() == {}


def test_a_plugin_declares_its_variables_into_flags():
    for flag in (cuda_env.KV_STORE, cuda_env.DISABLE_CPP, cuda_env.CPP_VERBOSE, cuda_env.CACHE_DIR):
        assert env.FLAGS[flag.name] is flag
    assert env.declare(cuda_env.KV_STORE) == (cuda_env.KV_STORE,)  # the same flag again: nothing changes
    with pytest.raises(ValueError, match="ATTNPLUG_KV_STORE is declared twice"):
        env.declare(env.EnvFlag("ATTNPLUG_KV_STORE", "something else", "x"))


# ---------------------------------------------------------------------------- values
SWITCHES = [
    (env.VALIDATE, env.validation_enabled),
    (env.DISABLE_PDL, env.pdl_disabled),
    (cuda_env.DISABLE_CPP, cuda_env.cpp_disabled),
    (cuda_env.CPP_VERBOSE, cuda_env.cpp_verbose),
]


@pytest.mark.parametrize("flag, read", SWITCHES, ids=lambda x: getattr(x, "name", ""))
def test_switches(monkeypatch, flag, read):
    for value, expected in (
        ("1", True),
        ("true", True),
        (" YES ", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
    ):
        monkeypatch.setenv(flag.name, value)
        assert read() is expected, value
    for bad in ("ture", "2", "enabled", "-1"):
        monkeypatch.setenv(flag.name, bad)
        with pytest.raises(env.EnvError, match=rf"^{flag.name}='{bad}': expected a switch: 1, true"):
            read()


def test_names(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNPLUG_BACKEND", " cuda ")
    assert env.backend_name() == "cuda"
    monkeypatch.setenv("ATTNPLUG_PLUGINS", " a , c,")
    assert env.plugin_allow_list() == ("a", "c")
    monkeypatch.setenv("ATTNPLUG_PLUGINS", ", ,")
    with pytest.raises(env.EnvError, match=r"^ATTNPLUG_PLUGINS=', ,': expected comma-separated plugin names"):
        env.plugin_allow_list()
    monkeypatch.setenv("ATTNPLUG_KV_STORE", "CPP")
    assert cuda_env.kv_store_kernel() == "cpp"
    monkeypatch.setenv("ATTNPLUG_KV_STORE", "cutlass")
    with pytest.raises(env.EnvError, match=r"^ATTNPLUG_KV_STORE='cutlass': expected 'triton' or 'cpp'"):
        cuda_env.kv_store_kernel()
    monkeypatch.setenv("ATTNPLUG_CACHE_DIR", str(tmp_path / "c"))
    assert cuda_env.cache_dir() == tmp_path / "c"
    monkeypatch.setenv("ATTNPLUG_CACHE_DIR", "~/x")
    assert cuda_env.cache_dir() == pathlib.Path.home() / "x"


def test_probe_timeout(monkeypatch):
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "0.25")
    assert env.probe_timeout() == 0.25
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "inf")
    assert env.probe_timeout() is None
    for bad in ("0", "-1", "soon", "nan", "-inf"):
        monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", bad)
        with pytest.raises(env.EnvError, match=rf"^ATTNPLUG_PROBE_TIMEOUT='{bad}': expected a positive number"):
            env.probe_timeout()


def test_env_error_is_a_value_error_and_flags_set_reports_raw_values(monkeypatch):
    assert issubclass(env.EnvError, ValueError)
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    monkeypatch.setenv("ATTNPLUG_KV_STORE", "cpp ")
    assert env.flags_set() == {"ATTNPLUG_VALIDATE": "1", "ATTNPLUG_KV_STORE": "cpp "}


# ---------------------------------------------------------------------------- one source
def _code_tokens(path: pathlib.Path):
    """(line, string) of the string tokens of a file that are not docstrings."""
    previous = tokenize.ENCODING
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.STRING and previous not in (
            tokenize.NEWLINE,
            tokenize.NL,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENCODING,
        ):
            yield tok.start[0], tok.string
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type


def _sources():
    for tree in CODE_TREES:
        yield from sorted((ROOT / tree).rglob("*.py"))


#: a read: os.environ.get / os.getenv / os.environ[...] other than an assignment
READ = re.compile(
    r"""(environ\.get|getenv)\s*\(\s*f?["']ATTNPLUG_|environ\[\s*f?["']ATTNPLUG_\w*["']\s*\](?!\s*=[^=])"""
)
NAME = re.compile(r"ATTNPLUG_[A-Z0-9_]+")


def test_no_module_but_env_reads_an_attnplug_variable():
    offenders = []
    env_modules = {ROOT / "core" / "attnplug" / "env.py", ROOT / "plugins" / "cuda" / "attnplug_cuda" / "env.py"}
    for path in _sources():
        if path in env_modules:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if READ.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "read ATTNPLUG_* variables through a declared flag:\n" + "\n".join(offenders)


def test_every_variable_named_in_code_or_docs_is_declared_and_documented():
    known = set(env.FLAGS)
    unknown = []
    for path in _sources():
        for number, text in _code_tokens(path):
            unknown += [f"{path.relative_to(ROOT)}:{number}: {n}" for n in NAME.findall(text) if n not in known]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        unknown += [f"{path.relative_to(ROOT)}: {n}" for n in NAME.findall(path.read_text()) if n not in known]
    assert not unknown, "not declared in attnplug.env.FLAGS:\n" + "\n".join(unknown)
    readme = (ROOT / "README.md").read_text()
    assert [n for n in known if n not in readme] == [], "README.md documents every variable"
    tables = env.__doc__ + cuda_env.__doc__
    assert [n for n in known if f"``{n}``" not in tables] == [], "the declaring env module's table lists every variable"


def test_detector_finds_a_direct_read():
    assert READ.search('x = os.environ.get("ATTNPLUG_VALIDATE", "")')
    assert READ.search("os.getenv('ATTNPLUG_X')") and READ.search('os.environ["ATTNPLUG_X"]')
    assert READ.search('if os.environ["ATTNPLUG_X"] == "1":')
    assert not READ.search('monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")')
    assert not READ.search('os.environ["ATTNPLUG_DISABLE_PDL"] = "1"')
