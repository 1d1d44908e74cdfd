"""``paged_prefill_sm90``'s Hopper tiles against a float64 dense masked softmax, through
``paged_cases`` (the cases of ``paged_attention``'s tests: full and SWA layers, windows, soft
caps, sinks, table entries that are no keys, prefixes). Only on a compute capability 9.0 GPU
whose Triton has Gluon: these tiles are compiled, never interpreted (their sm_90 compile on the
host: ``sm90_compile.py``)."""

import pytest
import torch

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("the wgmma tiles run on a compute capability 9.0 GPU", allow_module_level=True)
pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from paged_cases import run_case  # noqa: E402

#: the tiles the planner gives (PagedPlan.WGMMA), forced onto these cases' shapes
TILES = dict(BLOCK_M=128, BLOCK_N=128, NUM_SPLITS=1, PHASES=True, PREFETCH=0, num_warps=8, WGMMA=True)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([300], [300]),  # one prompt: diagonal blocks, unmasked interior
        ([300, 70, 150], [300, 200, 150]),  # a prefix (request 1), programs past short requests
        ([33], [500]),  # 132 rows: two row blocks, the second almost empty
    ],
)
def test_full_layers_match_float64(q_lens, seq_lens, dtype, stages):
    run_case(q_lens, seq_lens, H=8, Hkv=2, D=128, dtype=dtype, layer="full", config={**TILES, "num_stages": stages})


@pytest.mark.parametrize("window", [1, 40, 128, 129, 1000])
def test_swa_layers_match_float64(window):
    """The window table (``start``), the masked blocks below each row's window, NaN in the
    slots no query can reach."""
    run_case([300, 70], [300, 400], H=8, Hkv=2, D=128, dtype=torch.bfloat16, layer="swa", window=window,
             config={**TILES, "num_stages": 2}, seed=window)  # fmt: skip


def test_softcap_and_sinks_match_float64():
    sinks = torch.randn(8) * 2
    run_case([200, 90], [260, 90], H=8, Hkv=2, D=128, dtype=torch.bfloat16, softcap=20.0, sinks=sinks,
             config={**TILES, "num_stages": 3}, seed=3)  # fmt: skip
    run_case([200], [200], H=8, Hkv=2, D=128, dtype=torch.bfloat16, layer="swa", window=50, softcap=5.0,
             sinks=sinks, config={**TILES, "num_stages": 2}, seed=4)  # fmt: skip
