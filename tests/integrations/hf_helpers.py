"""Helpers of the transformers integration tests."""

import torch

from attnplug import ForwardBatch, ForwardMode


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' own greedy ``generate`` (the model's attention implementation as loaded),
    never stopping early: the new tokens."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt) :].tolist()
    assert len(new) == max_new_tokens
    return new


def random_prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def one_request_batch(mode, row, seq_len, out_cache_loc, positions, extend_len=None):
    """The ``ForwardBatch`` of one request (table row ``row``, ``seq_len`` tokens after the step)
    on ``positions``' device; ``extend_len``: the tokens an EXTEND step adds."""
    dev = positions.device
    return ForwardBatch(
        forward_mode=mode,
        batch_size=1,
        req_pool_indices=torch.tensor([row], device=dev),
        seq_lens=torch.tensor([seq_len], device=dev),
        out_cache_loc=out_cache_loc,
        positions=positions,
        extend_seq_lens=None if extend_len is None else torch.tensor([extend_len], device=dev),
        extend_seq_lens_cpu=None if extend_len is None else [extend_len],
    )


def one_request_logits(runner, prompt, chunks):
    """Run ``prompt`` through ``runner`` in EXTEND chunks, then one DECODE step of its last
    token; returns the logits of every position (float32 [len(prompt) + 1, vocab])."""
    alloc, rows, dev = runner.allocator, runner.req_to_token_pool, runner.pool.device
    row, slots, seq, out = rows.alloc(), [], 0, []
    tokens = prompt + [prompt[-1]]
    for mode, n in [(ForwardMode.EXTEND, c) for c in chunks] + [(ForwardMode.DECODE, 1)]:
        last = slots[-1] if slots else -1
        if mode is ForwardMode.DECODE:
            loc = alloc.alloc_decode([seq + 1], [last])
        else:
            loc = alloc.alloc_extend([seq], [seq + n], [last])
        rows.req_to_token[row, seq : seq + n] = loc.to(torch.int32)
        slots += loc.tolist()
        positions = torch.arange(seq, seq + n, device=dev)
        batch = one_request_batch(mode, row, seq + n, loc, positions, n if mode is ForwardMode.EXTEND else None)
        out.append(runner.forward(batch, torch.tensor(tokens[seq : seq + n], device=dev), positions))
        seq += n
        alloc.evict_out_of_window(rows, row, seq, runner.spec.sliding_window or 10**6)
    alloc.free(torch.tensor(slots))
    rows.free(row)
    return torch.cat(out)
