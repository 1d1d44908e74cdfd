"""``attnplug generate``: a tiny model offline, a saved model folder, and its errors (each one
line starting ``attnplug: error: generate:``)."""

import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from hf_helpers import hf_greedy  # noqa: E402

from attnplug import cli  # noqa: E402
from attnplug.integrations.transformers import tiny_model  # noqa: E402


def _run(argv, capsys):
    try:
        code = cli.main(["generate", *argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tiny_model_generates_transformers_tokens(capsys):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41]]
    code, out, err = _run(
        ["--tiny", "qwen3", "--backend", "reference", "--max-new-tokens", "6"]
        + [a for p in prompts for a in ("--tokens", ",".join(map(str, p)))],
        capsys,
    )
    assert code == 0, err
    model = tiny_model("qwen3")
    want = [f"[{i}] " + " ".join(map(str, hf_greedy(model, p, 6))) for i, p in enumerate(prompts)]
    assert out.splitlines() == want
    assert "backend reference, torch.float32, cpu: 12 tokens" in err


def test_model_folder_with_tokens_and_without_tokenizer(tmp_path, capsys):
    model = tiny_model("gemma2")
    model.save_pretrained(tmp_path)
    want = " ".join(map(str, hf_greedy(model, [7, 8, 9], 4)))
    code, out, err = _run(["--model", str(tmp_path), "--tokens", "7 8 9", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    assert out.strip() == f"[0] {want}"
    code, out, err = _run(["--model", str(tmp_path), "--prompt", "hello"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"attnplug: error: generate: --prompt needs a tokenizer and {str(tmp_path)!r} has none: pass --tokens IDS"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tiny", "llama", "--tokens", "1,x"],
            "--tokens '1,x': token ids are integers separated by commas or spaces",
        ),
        (["--tiny", "llama", "--tokens", "300"], "prompts[0] holds token 300, outside the vocabulary [0, 256)"),
        (["--tiny", "llama", "--tokens", "1", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--model", "/no/such/folder", "--tokens", "1"], "--model '/no/such/folder': no such folder"),
        (["--tiny", "llama", "--tokens", "1", "--backend", "nope"], "no backend named 'nope'"),
        (["--tokens", "1"], "one of the arguments --model --tiny is required"),
    ],
)
def test_errors(argv, message, capsys):
    code, _out, err = _run(argv, capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("attnplug: error: generate: ") and message in last, last


def test_missing_transformers_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    code, _out, err = _run(["--tiny", "llama", "--tokens", "1"], capsys)
    assert code == 2
    assert err.strip() == (
        "attnplug: error: generate: the transformers integration needs the transformers package: "
        "pip install 'attnplug[hf]'"
    )


def test_tiny_models_take_a_head_dim_the_backend_serves():
    """``--tiny`` on a backend without the tiny head dim (the cuda backend serves 64, 128, 256)
    builds the tiny model with the smallest head dim the backend serves."""
    import dataclasses

    from attnplug.backends.reference import ReferenceBackend
    from attnplug.integrations.transformers.command import _tiny_head_dim

    class WideHeads(ReferenceBackend):
        @classmethod
        def declared_capabilities(cls):
            return dataclasses.replace(super().declared_capabilities(), head_dims=(128, 64))

    assert _tiny_head_dim(WideHeads) == {"head_dim": 64}
    assert _tiny_head_dim(ReferenceBackend) == {}
    assert tiny_model("llama", **_tiny_head_dim(WideHeads)).config.head_dim == 64
