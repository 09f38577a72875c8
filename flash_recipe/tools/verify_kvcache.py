"""``flash-recipe verify --kvcache``: ``flash_attn_with_kvcache`` against an oracle that rebuilds
each batch entry's cache in torch (see ``flash_recipe.tools.verify``): the cases (``KVCase``,
``KV_SMALL_GRID``, ``KV_FULL_GRID``), their inputs and ``check_kvcache_case``."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import torch

from ..decoding import flash_attn_with_kvcache
from ..dispatch import use_backend
from ..testing import FORWARD_FACTOR, accuracy_bound, attention, compute_dtype, max_error, rotary
from .sizes import Sizes


@dataclasses.dataclass(frozen=True)
class KVCase(Sizes):
    """One ``flash_attn_with_kvcache`` call: ``new`` rows appended to a cache that holds ``seqlens``
    rows per batch entry (``seqlen_k`` rows each, its ``capacity``), then ``seqlen_q`` queries attend
    over it.

    ``page`` > 0 stores the cache in shuffled pages of that many rows (``block_table``); ``rotary``
    is the rotary dim (0: none); ``leftpad`` the first valid row per entry (empty: 0);
    ``batch_idx`` maps batch element ``b`` to cache row ``batch + 1 - b`` of a cache with two
    spare rows; ``splits`` is ``num_splits`` (0: chosen from the GPU's size); ``sink`` (not None)
    gives every head an attention sink, ``sink + linspace(-1, 1, H)`` in the input dtype.
    """

    new: int
    seqlens: tuple
    causal: bool = True
    page: int = 0
    rotary: int = 0
    interleaved: bool = True
    leftpad: tuple = ()
    batch_idx: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    splits: int = 0
    sink: Optional[float] = None

    @property
    def capacity(self) -> int:
        """Rows each batch entry's cache holds: ``seqlen_k``."""
        return self.seqlen_k

    @property
    def id(self) -> str:
        parts = [
            f"kv-B{self.batch}-Sq{self.seqlen_q}-new{self.new}-H{self.nheads}-Hk{self.nheads_k}-D{self.head_dim}",
            f"cap{self.capacity}",
            f"page{self.page}" if self.page else "dense",
            "causal" if self.causal else "full",
        ]
        if self.rotary:
            parts.append(f"rot{self.rotary}{'i' if self.interleaved else 'n'}")
        for flag, name in ((self.leftpad, "leftpad"), (self.batch_idx, "batchidx"), (self.alibi, "alibi")):
            if flag:
                parts.append(name)
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.sink is not None:
            parts.append(f"sink{self.sink:g}")
        parts.append(f"split{self.splits}")
        return "-".join(parts)


# Small enough for the Triton interpreter: a decoding step with GQA; several new tokens into a
# paged cache with GPT-NeoX rotary, left padding, a window and split-KV; a full cache with nothing
# appended, batch indices, softcap and ALiBi (no causal mask).
KV_SMALL_GRID = (
    KVCase(2, 1, 64, 4, 2, 32, seqlens=(5, 40), new=1),
    KVCase(
        batch=2,
        seqlen_q=3,
        new=3,
        nheads=4,
        nheads_k=2,
        head_dim=32,
        seqlens=(10, 27),
        seqlen_k=64,
        page=16,
        rotary=16,
        interleaved=False,
        leftpad=(2, 0),
        window=(8, 0),
        splits=2,
    ),
    KVCase(
        batch=3,
        seqlen_q=2,
        new=0,
        nheads=2,
        nheads_k=1,
        head_dim=24,
        seqlens=(7, 33, 48),
        seqlen_k=48,
        causal=False,
        batch_idx=True,
        softcap=3.0,
        alibi=True,
        splits=3,
    ),
    # gpt-oss decoding: GQA, attention sinks, a window, a paged cache with rows appended, split-KV.
    KVCase(2, 1, 64, 8, 2, 32, seqlens=(3, 50), new=1, page=16, window=(20, 0), splits=3, sink=0.0),
)

# On a GPU: realistic decoding and chunked prefill over caches of thousands of rows, every
# head-dim bucket, pages of 16 and 256 rows, split-KV chosen automatically.
KV_FULL_GRID = KV_SMALL_GRID + (
    KVCase(4, 1, 4096, 32, 8, 128, seqlens=(1000, 4095, 17, 2047), new=1),
    KVCase(3, 4, 4096, 16, 2, 128, seqlens=(300, 2000, 4092), new=4, page=256, rotary=64, interleaved=False),
    KVCase(
        batch=2,
        seqlen_q=128,
        new=128,
        nheads=8,
        nheads_k=8,
        head_dim=64,
        seqlens=(0, 900),
        seqlen_k=2048,
        page=16,
        rotary=32,
        leftpad=(0, 37),
        window=(256, 0),
    ),
    KVCase(2, 5, 2048, 8, 4, 256, seqlens=(777, 1500), new=0, causal=False, batch_idx=True, alibi=True, splits=4),
    KVCase(2, 1, 3072, 12, 1, 96, seqlens=(3000, 1), new=1, window=(100, 0), softcap=30.0),
    KVCase(4, 1, 4096, 64, 8, 64, seqlens=(4000, 127, 128, 2500), new=1, page=256, window=(127, 0), sink=1.0),
)


def kv_inputs(case: KVCase, dtype, device, seed: int):
    """Deterministic inputs of one KV case: ``(q, k_cache, v_cache, k_new, v_new, kwargs)``, where
    ``kwargs`` are the remaining arguments of ``flash_attn_with_kvcache``. Drawn on the CPU."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, hk, d = case.batch, case.nheads_k, case.head_dim
    q = rand(b, case.seqlen_q, case.nheads, d)
    k_new = rand(b, case.new, hk, d) if case.new else None
    v_new = rand(b, case.new, hk, d) if case.new else None
    kwargs = dict(
        cache_seqlens=torch.tensor(case.seqlens, dtype=torch.int32, device=device),
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        num_splits=case.splits,
    )
    if case.page:
        width = case.capacity // case.page
        num_pages = b * width + 3  # pages no sequence uses must stay untouched
        order = torch.randperm(num_pages, generator=gen)[: b * width]
        kwargs["block_table"] = order.view(b, width).to(device=device, dtype=torch.int32)
        cache_shape = (num_pages, case.page, hk, d)
    else:
        rows = b + 2 if case.batch_idx else b
        cache_shape = (rows, case.capacity, hk, d)
        if case.batch_idx:
            kwargs["cache_batch_idx"] = torch.tensor([b + 1 - i for i in range(b)], dtype=torch.int32, device=device)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    if case.leftpad:
        kwargs["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
    if case.rotary:
        # RoPE tables: position p, pair j turns by p * 10000^(-2j / rotary_dim); rounded to q's dtype.
        positions = torch.arange(case.capacity, dtype=torch.float64)[:, None]
        inv_freq = 10000.0 ** (-torch.arange(0, case.rotary, 2, dtype=torch.float64) / case.rotary)
        angle = positions * inv_freq
        kwargs.update(
            rotary_cos=angle.cos().to(device=device, dtype=dtype),
            rotary_sin=angle.sin().to(device=device, dtype=dtype),
            rotary_interleaved=case.interleaved,
        )
    if case.alibi:
        kwargs["alibi_slopes"] = torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / case.nheads) for h in range(case.nheads)], device=device
        )
    if case.sink is not None:
        kwargs["learnable_sink"] = (case.sink + torch.linspace(-1.0, 1.0, case.nheads)).to(device=device, dtype=dtype)
    return q, k_cache, v_cache, k_new, v_new, kwargs


def _kv_slots(case: KVCase, kwargs: dict, b: int, start: int, end: int) -> tuple:
    """``(index0, index1)`` of rows ``[start, end)`` of batch element ``b``'s cache entry, for a
    cache tensor indexed ``cache[index0, index1]``: (page, row in page) or (cache row, position)."""
    device = kwargs["cache_seqlens"].device
    positions = torch.arange(start, end, device=device)
    if case.page:
        table = kwargs["block_table"][b].long()
        return table[positions // case.page], positions % case.page
    row = kwargs["cache_batch_idx"][b] if case.batch_idx else b
    return torch.full_like(positions, int(row)), positions


def _kv_oracle(case: KVCase, q, k_cache, v_cache, k_new, v_new, kwargs: dict, upcast: bool):
    """What the call must return and write: ``(out, k_cache_after, v_cache_after)``.

    ``upcast``: the truth (rotation in fp64, attention in ``compute_dtype(dtype, True)``), else
    plain PyTorch in the input dtype throughout. The caches come back in the compute precision.
    """
    dtype, device = q.dtype, q.device
    high = compute_dtype(dtype, upcast)
    rot_dtype = torch.float64 if upcast else dtype
    k_after, v_after = k_cache.to(high, copy=True), v_cache.to(high, copy=True)
    moves = case.causal or case.window != (-1, -1)  # q rotates at each row's own position
    cos, sin = kwargs.get("rotary_cos"), kwargs.get("rotary_sin")
    outs = []
    for b in range(case.batch):
        n = case.seqlens[b]
        pad = case.leftpad[b] if case.leftpad else 0
        if case.new:
            k_b, v_b = k_new[b], v_new[b]
            if case.rotary:
                positions = torch.arange(n, n + case.new, device=device)
                k_b = rotary(k_b[None], cos, sin, positions[None], case.interleaved, rot_dtype)[0]
            slots = _kv_slots(case, kwargs, b, n, n + case.new)
            k_after[slots] = k_b.to(high)
            v_after[slots] = v_b.to(high)
        q_b = q[b]
        if case.rotary:
            positions = torch.arange(n, n + case.seqlen_q, device=device)
            if not moves:
                positions = torch.full_like(positions, n)
            q_b = rotary(q_b[None], cos, sin, positions[None], case.interleaved, rot_dtype)[0]
        visible = _kv_slots(case, kwargs, b, pad, n + case.new)
        keys, values = k_after[visible][None], v_after[visible][None]
        slopes = kwargs.get("alibi_slopes")
        out, _ = attention(
            q_b.to(high)[None],
            keys,
            values,
            case.head_dim**-0.5,
            case.causal,
            keys.shape[1] - case.seqlen_q,
            upcast=upcast,
            window=case.window,
            softcap=case.softcap,
            alibi_slopes=slopes,
            sinks=kwargs.get("learnable_sink"),
        )
        outs.append(out)
    return torch.cat(outs), k_after, v_after


def check_kvcache_case(case: KVCase, dtype, device, backend: str, seed: int) -> dict:
    """Verify ``flash_attn_with_kvcache`` on one backend and one KV case (see the module docstring).

    Raises ``flash_recipe.BackendUnavailableError`` when the backend cannot run the case.
    Errors: ``out`` (bound: the accuracy rule, 2x), ``k_cache`` and ``v_cache``
    over the written rows (exact, except rotated keys: the rule, 2x), ``cache_rest`` over every other
    row of both caches (exact).
    """
    q, k_cache, v_cache, k_new, v_new, kwargs = kv_inputs(case, dtype, device, seed)
    k_got, v_got = k_cache.clone(), v_cache.clone()
    with use_backend(backend):
        out = flash_attn_with_kvcache(q, k_got, v_got, k_new, v_new, **kwargs)
    truth = _kv_oracle(case, q, k_cache, v_cache, k_new, v_new, kwargs, upcast=True)
    same = _kv_oracle(case, q, k_cache, v_cache, k_new, v_new, kwargs, upcast=False)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for b in range(case.batch):
        written[_kv_slots(case, kwargs, b, case.seqlens[b], case.seqlens[b] + case.new)] = True
    errors = {
        "out": max_error(out, truth[0]),
        "k_cache": max_error(k_got[written], truth[1][written]),
        "v_cache": max_error(v_got[written], truth[2][written]),
        "cache_rest": max(max_error(k_got[~written], k_cache[~written]), max_error(v_got[~written], v_cache[~written])),
    }
    bounds = {
        "out": accuracy_bound(max_error(same[0], truth[0]), FORWARD_FACTOR),
        "k_cache": accuracy_bound(max_error(same[1][written], truth[1][written]), FORWARD_FACTOR)
        if case.rotary
        else 0.0,
        "v_cache": 0.0,
        "cache_rest": 0.0,
    }
    return report_row(case.id, dtype, backend, errors, bounds, (out,), (out, k_got, v_got))


def report_row(case_id: str, dtype, backend: str, errors: dict, bounds: dict, outputs, fingerprinted) -> dict:
    """One row of ``verify``'s report: passed when every tensor of ``outputs`` is finite and every
    error is within its bound; the fingerprint is the SHA-256 of ``fingerprinted``'s bytes."""
    digest = hashlib.sha256()
    for t in fingerprinted:
        digest.update(t.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    finite = all(bool(t.isfinite().all()) for t in outputs)
    return {
        "case": case_id,
        "dtype": str(dtype).replace("torch.", ""),
        "backend": backend,
        "errors": errors,
        "bounds": bounds,
        "passed": finite and all(errors[n] <= bounds[n] for n in errors),
        "fingerprint": digest.hexdigest(),
    }
