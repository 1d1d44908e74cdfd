"""``attnplug generate``: greedy generation with a transformers model through attnplug.

``--model PATH`` loads a causal LM folder with ``from_pretrained(PATH,
attn_implementation="attnplug")`` and its tokenizer when the folder has one; ``--tiny ARCH``
builds a small random model offline (``tiny_model``; its 256-token vocabulary reads a
``--prompt`` as UTF-8 bytes). ``--kv-cache-dtype fp8`` (``fp8_e4m3``, ``fp8_e5m2``) stores the
KV cache in FP8 with every scale 1.0 (``Engine(kv_cache_dtype=...)``). Prints, per prompt, the
new token ids (and the text, with a tokenizer), then a summary on stderr.

Exit codes: 0 done; 2 the run cannot start (transformers missing, no tokenizer for
``--prompt``, bad ``--tokens``, a request longer than the model's positions, an unusable
``--device``, an unknown or unavailable backend, a malformed ``ATTNPLUG_*`` variable, a model or
backend attnplug cannot run, a KV cache dtype the backend does not serve, pools that do not fit
in memory); 130 / 143 when SIGINT / SIGTERM
stopped it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

from ...cli_errors import fail
from ...memory.fp8 import KV_CACHE_DTYPE_NAMES

__all__ = ["add_arguments", "run_command"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .spec import ARCHITECTURES

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", help="a transformers causal LM folder (or hub id when cached)")
    source.add_argument(
        "--tiny",
        metavar="ARCH",
        choices=ARCHITECTURES,
        help=f"a small random model built offline, no download ({', '.join(ARCHITECTURES)})",
    )
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt, encoded with the model's tokenizer (repeat for a batch)",
    )
    text.add_argument(
        "--tokens",
        action="append",
        metavar="IDS",
        help="a prompt as token ids, e.g. '1,15,27' (repeat for a batch)",
    )
    parser.add_argument("--backend", metavar="NAME", help="registry name or module:Class (default: the registry's)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=32, metavar="N", help="new tokens per prompt (default: 32)"
    )
    parser.add_argument("--device", metavar="DEVICE", help="torch device (default: the backend's)")
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="model and KV dtype (default: the model's own, or float32 for --tiny, when the backend serves it)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPE_NAMES),
        default="auto",
        help="what the KV cache stores: auto (the model's dtype, default), fp8 / fp8_e4m3 (float8_e4m3fn) or "
        "fp8_e5m2 (float8_e5m2), with every layer's scales 1.0",
    )
    parser.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps through device graphs (default: when the backend has them)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the model with torch.compile for the decode graphs and the prefill steps (attention stays "
        "attnplug's op)",
    )


def _parse_tokens(text: str) -> List[int]:
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"--tokens {text!r}: token ids are integers separated by commas or spaces") from None
    if not ids:
        raise ValueError(f"--tokens {text!r} holds no token id")
    return ids


def _backend_and_device(args):
    """``(--backend or None, device, backend class)`` of the run: the named backend, else the
    registry's default; the device from ``--device``, else the backend's."""
    from ...registry import get_registry
    from ...selection import resolve_backend

    name = args.backend or get_registry().select()[0]
    resolved = resolve_backend(name, args.device)
    return args.backend, torch.device(args.device) if args.device else resolved.device, resolved.cls


def _dtype(args, cls, config_dtype: Optional[torch.dtype]) -> torch.dtype:
    if args.dtype:
        return _DTYPES[args.dtype]
    caps = cls.installed_capabilities()
    supported = caps.dtypes if caps is not None else ()
    preferred = [config_dtype] if config_dtype is not None else [torch.float32]
    for dtype in preferred + [torch.bfloat16, torch.float16, torch.float32]:
        if dtype in supported:
            return dtype
    return preferred[0]


def _tiny_head_dim(cls) -> dict:
    """``{"head_dim": d}`` when the backend does not serve the tiny models' head dim: the
    smallest one it serves (e.g. 64 on the cuda backend); else no override."""
    from .tiny import tiny_config

    caps = cls.installed_capabilities()
    if caps is None or not caps.head_dims or tiny_config("llama").head_dim in caps.head_dims:
        return {}
    return {"head_dim": min(caps.head_dims)}


def _load(args, cls, device):
    """(model, tokenizer or None)."""
    from .errors import require_transformers
    from .tiny import tiny_model

    if args.tiny:
        model = tiny_model(
            args.tiny,
            dtype=_dtype(args, cls, None),
            device=device,
            attn_implementation="attnplug",
            **_tiny_head_dim(cls),
        )
        return model, None
    transformers = require_transformers()
    from .attention import IMPLEMENTATION, register

    if args.model.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(args.model)):
        raise ValueError(f"--model {args.model!r}: no such folder")

    register()
    config = transformers.AutoConfig.from_pretrained(args.model)
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, attn_implementation=IMPLEMENTATION, dtype=_dtype(args, cls, config_dtype)
    ).to(device)
    tokenizer = None
    if os.path.isdir(args.model) and not any(
        os.path.exists(os.path.join(args.model, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return model.eval(), None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    except Exception:  # a folder without a usable tokenizer: --tokens still works
        tokenizer = None
    return model.eval(), tokenizer


def _prompts(args, tokenizer) -> List[List[int]]:
    if args.tokens:
        return [_parse_tokens(t) for t in args.tokens]
    if args.tiny:
        return [list(t.encode("utf-8")) for t in args.prompt]
    if tokenizer is None:
        raise ValueError(f"--prompt needs a tokenizer and {args.model!r} has none: pass --tokens IDS")
    return [tokenizer(t)["input_ids"] for t in args.prompt]


def _check_length(model, prompts: List[List[int]], max_new_tokens: int) -> int:
    """The longest request (prompt + ``max_new_tokens``); ``ValueError`` when it exceeds the
    model's ``max_position_embeddings`` (the positions it was made for: beyond them the
    tokens are not the model's, and the pools would be sized for nothing)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < longest:
        index = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        raise ValueError(
            f"prompts[{index}]: {len(prompts[index])} prompt tokens + --max-new-tokens {max_new_tokens} = {longest} "
            f"exceed the model's max_position_embeddings = {limit}"
        )
    return longest


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (host or device memory)."""
    if isinstance(exc, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def run_command(args: argparse.Namespace) -> int:
    from ...registry import RegistryError
    from ...selection import SelectionError
    from .engine import Engine
    from .errors import MissingDependencyError, UnsupportedModelError

    if args.max_new_tokens < 1:
        return fail(f"generate: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    device = args.device or "the device"
    try:
        backend, device, cls = _backend_and_device(args)
        model, tokenizer = _load(args, cls, device)
        prompts = _prompts(args, tokenizer)
        eos = None if args.tiny else getattr(model.generation_config, "eos_token_id", None)
        longest = _check_length(model, prompts, args.max_new_tokens)
        engine = Engine(
            model,
            backend or cls,
            max_batch_size=len(prompts),
            max_context_len=longest,
            cuda_graphs=args.graphs,
            compile=args.compile,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        outputs = engine.generate(prompts, args.max_new_tokens, eos_token_id=eos)
    except (MissingDependencyError, UnsupportedModelError, SelectionError, RegistryError, ValueError, OSError) as exc:
        return fail(f"generate: {exc}")
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        advice = "fewer or shorter prompts, a smaller --max-new-tokens"
        return fail(f"generate: out of memory on {device} ({advice}): {first}")
    for i, out in enumerate(outputs):
        line = f"[{i}] " + " ".join(map(str, out))
        if tokenizer is not None:
            line += "\n    " + repr(tokenizer.decode(out))
        print(line)
    run = engine.last_run
    seconds = float(run["seconds"])
    print(
        f"backend {engine.runner.backend.name}, {engine.runner.dtype}, {engine.runner.device}: "
        f"{run['tokens']} tokens in {seconds:.2f} s ({run['tokens'] / max(seconds, 1e-9):.1f} tok/s), "
        f"steps {run['steps']}, graph steps {run['graph_steps']}, "
        f"KV cache {str(engine.runner.kv_cache_dtype).replace('torch.', '')}",
        file=sys.stderr,
    )
    return 0
