"""``offline_compile`` on a machine without a GPU: a recorded launch is compiled with the
specialisation its arguments give (the alignment a GPU launch would see); the PDL prologue's
L2 prefetch in ``paged_attention``'s compiled code; its prefill tiles' K/V pipeline and
products."""

import json
import os
import subprocess
import sys

import pytest

from child import HANG_LIMIT_S

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

pytestmark = pytest.mark.slow  # compiles kernels offline


HERE = os.path.dirname(__file__)


def _run(*argv):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=HANG_LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def test_a_launch_compiles_with_the_alignment_of_its_arguments():
    result = json.loads(_run(os.path.join(HERE, "offline_compile_probe.py")).strip().splitlines()[-1])
    # 16-byte aligned bf16 rows: one 16-byte load per thread; shifted by one element: none
    assert result["aligned"]["wide_loads"] >= 1, result
    assert result["misaligned"]["wide_loads"] == 0, result
    for r in result.values():
        assert r["threads"] == 128 and r["registers"] > 0 and r["programs_per_sm"] >= 1


def test_paged_attention_prefetches_its_first_key_blocks_before_the_wait():
    """With the PDL prologue, ``PREFETCH`` blocks' cached K/V lines are sent to L2 before
    ``griddepcontrol.wait`` (each depth adds the same count: one block's K and V lines), none
    without it, at no register cost; the plan's decode tiles take one block."""
    result = json.loads(_run(os.path.join(HERE, "paged_prefetch_probe.py")).strip().splitlines()[-1])
    none, one, two, plan = result["0"], result["1"], result["2"], result["plan"]
    assert none["prefetches"] == 0, result
    assert one["prefetches"] > 0 and two["prefetches"] == 2 * one["prefetches"], result
    for r in (one, two):
        assert r["before_wait"] == r["prefetches"], result
    assert plan["depth"] == 1 and plan["prefetches"] == one["prefetches"], result
    assert one["registers"] <= none["registers"] + 8, result


def test_paged_attention_prefill_tiles_pipeline_their_kv_tiles_to_the_stages():
    """The head dim 128 flash tiles read each key block's slots from the key table one block
    ahead (``PagedPlan.SLOTS_AHEAD``), so Triton's pipeliner buffers their K/V tiles as deep
    as the launch's stages: one more stage takes one more key block's K and V tiles of shared
    memory. (With the table read in the iteration that used it, a third stage took no more
    shared memory: the tiles stayed one block ahead.)"""
    result = json.loads(_run(os.path.join(HERE, "paged_pipeline_probe.py")).strip().splitlines()[-1])
    assert result["128"]["plan"]["slots_ahead"], result
    for head_dim, r in result.items():
        plan, deeper = r["plan"], r["deeper"]
        assert plan["block_m"] == 128 and deeper["stages"] == plan["stages"] + 1, result
        if plan["slots_ahead"]:
            assert deeper["shared_bytes"] - plan["shared_bytes"] >= plan["kv_block_bytes"], (head_dim, result)


def test_paged_attention_prefill_products_are_not_serialised():
    """The head dim 128 flash tiles (full layer and window) settle each key block's products in
    its iteration (``PagedPlan.SETTLE``): ptxas reports no "Potential Performance Loss" and
    each key-block loop waits for its ``wgmma`` groups at most twice (QK^T, then P·V). With the
    P·V products in flight across the loop's back edge, Triton 3.6's PTX of these tiles (32 q /
    8 kv heads) made ptxas serialise every ``wgmma`` (C7515): 16 waits a block."""
    result = json.loads(_run(os.path.join(HERE, "flash_products_probe.py")).strip().splitlines()[-1])
    for case in ("full plan", "window plan"):
        r = result[case]
        assert r["slots_ahead"] and r["settle"], result
        assert r["losses"] == [], result
        assert r["loops"] and all(1 <= loop["depbar"] <= 2 for loop in r["loops"]), result
    assert not result["full unsettled"]["settle"], result


def test_paged_attention_quantises_each_new_value_of_an_fp8_step_once():
    """A launch storing the step into an FP8 cache quantises a tile of the request's tokens
    (``NEW_TOKENS``: the step's host bound ``max_q_len``, a power of two), not of its (token, q
    head) rows nor of every token its row block could hold: one IEEE division a stored K or V
    value of the tile, ``2 * tokens * D / threads`` a thread, 2 for a decode step. (A tile of
    rows quantised each value once per q head of the group: 32 divisions a thread at groups of
    4 and 8, the step's fixed cost that made a window layer's FP8 launch as slow as its 16-bit
    one; a tile of the row block's tokens, 4 at a group of 4, quantised three empty tokens a
    decode step: 8 a thread.)"""
    result = json.loads(_run(os.path.join(HERE, "paged_store_probe.py")).strip().splitlines()[-1])
    assert set(result) == {"decode 4", "decode 8", "draft 4"}, result
    for r in result.values():
        assert r["tokens"] == r["q_len"] and r["tokens"] < r["rows"], result
        assert r["divisions"] == 2 * r["tokens"] * r["head_dim"] // r["threads"], result


def test_fp8_decode_tiles_reach_the_products_as_16_bit_tiles():
    """Over an FP8 cache (both dtypes) ``store_attend``'s planned decode tiles convert K and V
    to float16 by PTX where they are loaded (``OneLaunchPlan.FP8_PTX``, ``common.product_tile``):
    no byte is read from shared memory and the tiles reach the products through ``ldmatrix``,
    V's transposed. (With Triton's cast, V's operand pairs, which run along the keys, are read
    a byte at a time: 128 ``ld.shared.b8`` a thread a 128-key block.) ``paged_attention``'s
    decode tiles of one token a request (``PagedPlan.ONE_TOKEN``) mask no key by position:
    fewer compares and registers than the masked loop."""
    result = json.loads(_run(os.path.join(HERE, "fp8_tile_probe.py")).strip().splitlines()[-1])
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        plan, cast = result[f"store_attend {dtype} plan"], result[f"store_attend {dtype} cast"]
        assert plan["fp8_ptx"] and not cast["fp8_ptx"], result
        assert plan["byte_loads"] == 0 and cast["byte_loads"] > 0, result
        assert plan["ldmatrix_trans"] > 0 and plan["ldmatrix"] > cast["ldmatrix"], result
        plan, masked = result[f"paged {dtype} plan"], result[f"paged {dtype} masked"]
        assert plan["one_token"] and not masked["one_token"], result
        assert plan["compares"] < masked["compares"] and plan["registers"] <= masked["registers"], result
