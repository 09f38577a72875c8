"""KV-cache and paged-key semantics in torch, around a backend's dense attention calls.

For backends without cache kernels: the rotary embedding and the cache writes by indexing, then
one dense call per batch entry over its gathered keys (``run_cache``); paged keys gathered into
packed ones for one varlen call (``run_paged``). Both are forward only, as upstream, and read the
metadata on the host.
"""

from __future__ import annotations

import dataclasses

import torch

from ..reference import rotary_reference
from .call import CacheCall, PagedCall


def slots(pages: torch.Tensor, table_row: list, start: int, end: int) -> tuple:
    """Index tensors ``(page, row)`` of rows ``[start, end)`` of one sequence of a paged tensor
    ``(num_pages, page_size, ...)``: ``pages[slots(...)]`` reads them, assigning to it writes."""
    page_size = pages.shape[1]
    idx = torch.arange(start, end, device=pages.device)
    return torch.tensor(table_row, dtype=torch.long, device=pages.device)[idx // page_size], idx % page_size


def rows(pages: torch.Tensor, table_row: list, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of one sequence of a paged tensor ``(num_pages, page_size, ...)``."""
    return pages[slots(pages, table_row, start, end)]


def run_cache(backend, call: CacheCall) -> tuple:
    """``flash_attn_with_kvcache`` in torch, then ``backend.run`` once per batch entry."""
    q, att = call.q, call.attention
    batch, seqlen_q = q.shape[:2]
    lengths = call.seqlens.tolist()
    table = call.table.tolist()
    pads = call.leftpad.tolist() if call.leftpad is not None else [0] * batch
    new = call.new_tokens
    pos = torch.tensor(lengths, device=q.device)[:, None]
    k_new = call.k
    if call.rotary is not None:
        cos, sin, interleaved = call.rotary
        k_new = rotary_reference(k_new, cos, sin, pos + torch.arange(new, device=q.device), interleaved)
        step = 1 if att.window != (-1, -1) else 0
        q = rotary_reference(q, cos, sin, pos + step * torch.arange(seqlen_q, device=q.device), interleaved)
    with torch.no_grad():
        for b in range(batch):
            if new:
                written = slots(call.k_cache, table[b], lengths[b], lengths[b] + new)
                call.k_cache[written] = k_new[b]
                call.v_cache[written] = call.v[b]
        outs, lses = [], []
        for b in range(batch):
            k = rows(call.k_cache, table[b], pads[b], lengths[b] + new)[None]
            v = rows(call.v_cache, table[b], pads[b], lengths[b] + new)[None]
            part = dataclasses.replace(
                att, q=q[b : b + 1], k=k, v=v, diag_offset=k.shape[1] - seqlen_q, alibi_slopes=att.slopes_of(b)
            )
            out, lse, _ = backend.run(part)
            outs.append(out)
            lses.append(lse)
    lse = torch.cat(lses) if att.return_lse else None
    return torch.cat(outs), lse


def run_paged(backend, call: PagedCall) -> tuple:
    """Gather each sequence's pages into packed keys and run the backend's varlen call."""
    att = call.attention
    batch = att.cu_seqlens_q.numel() - 1
    table = call.block_table.tolist()
    starts = att.cu_seqlens_k.tolist()
    keys = [rows(att.k, table[b], 0, starts[b + 1] - starts[b]) for b in range(batch)]
    values = [rows(att.v, table[b], 0, starts[b + 1] - starts[b]) for b in range(batch)]
    total = torch.cat(keys) if keys else att.k.new_empty((0,) + tuple(att.k.shape[2:]))
    packed = dataclasses.replace(att, k=total, v=torch.cat(values) if values else total)
    out, lse, _ = backend.run_call(packed)
    return out, lse
