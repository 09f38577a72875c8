"""``flash_attn_interface`` of the FlashAttention-3 stand-in (``install_as_flash_attn_3()``):
FA3 3.0.0's public functions, with its names, argument order and defaults, on flash_recipe's
backends (so on every GPU flash_recipe runs on, and on CPUs).

- ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
  k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
  num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False)``:
  ``q (B, Sq, H, D)``, ``k, v (B, Sk, Hk, D)``; returns ``out (B, Sq, H, D)``, or
  ``(out, softmax_lse)`` with ``return_attn_probs``, ``softmax_lse (B, H, Sq)`` float32.
- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  seqused_q=None, seqused_k=None, ...)``: ``q (total_q, H, D)``, ``k, v (total_k, Hk, D)``;
  ``softmax_lse (H, total_q)``. ``seqused_q/k`` (int32 ``(B,)``) use only the first
  ``seqused[b]`` rows of sequence ``b``; the other query rows output 0 (lse ``+inf``).
- ``flash_attn_qkvpacked_func(qkv, ...)``: ``qkv (B, S, 3, H, D)``, or ``(B, S, H + 2 * Hk, D)``
  with ``num_heads_q=H``.
- ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
  rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
  page_table=None, ...)``: flash_recipe's ``flash_attn_with_kvcache`` (``page_table`` is its
  ``block_table``); returns ``out``, or ``(out, softmax_lse)`` with ``return_softmax_lse``.

Every function also takes the attention sinks as ``s_aux`` (``(H,)`` float; vLLM's FA3 build
names them so, and transformers passes them by that name). The masks, the scale default and the
lse follow flash_recipe's ``flash_attn_func`` (its docstring). Hints that change no result
(``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``) are checked and accepted.
Refused with NotImplementedError naming the argument: ``qv``, FP8 (``q/k/v_descale``),
``attention_chunk`` other than 0, and the kvcache call's ``cu_seqlens_q``, ``cu_seqlens_k_new``
and ``rotary_seqlens``.

``install_as_flash_attn_3(beta_returns=True)`` makes ``flash_attn_func`` and
``flash_attn_varlen_func`` return ``(out, softmax_lse)`` whatever ``return_attn_probs`` says, as
FA3's beta did before 2025-07 (code written for it, such as Wan2.x, indexes ``[0]``).
"""

from __future__ import annotations

import torch

from .. import api, decoding, validate

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
]

# Set by ``install_as_flash_attn_3(beta_returns=...)`` (module docstring).
beta_returns = False


def _refuse(name: str, value, allowed, why: str) -> None:
    if (value is not None) if allowed is None else (value != allowed):
        raise NotImplementedError(f"{name}: {why}; pass {allowed!r} (flash_recipe's FlashAttention-3 stand-in)")


def _check_fa3_only(qv, q_descale, k_descale, v_descale, attention_chunk, num_splits, pack_gqa, sm_margin) -> None:
    """FA3's arguments that flash_recipe's functions do not take: refused where they change the
    result and flash_recipe cannot compute it, checked and accepted where they are hints."""
    _refuse("qv", qv, None, "the extra query-value product (MLA decoding) is not provided")
    for name, scale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        _refuse(name, scale, None, "FP8 attention is not provided (sageattn gives 8-bit attention)")
    validate.check_int("attention_chunk", attention_chunk, 0)
    _refuse("attention_chunk", attention_chunk, 0, "chunked attention is not provided")
    validate.check_int("num_splits", num_splits, None, maximum=None)
    validate.check_int("sm_margin", sm_margin, 0)
    if pack_gqa is not None:
        validate.check_bool("pack_gqa", pack_gqa)


def _returns(out: torch.Tensor, lse: torch.Tensor, return_attn_probs) -> object:
    validate.check_bool("return_attn_probs", return_attn_probs)
    return (out, lse) if return_attn_probs or beta_returns else out


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """FA3's dense attention (module docstring): ``out``, or ``(out, softmax_lse (B, H, Sq))``."""
    _check_fa3_only(qv, q_descale, k_descale, v_descale, attention_chunk, num_splits, pack_gqa, sm_margin)
    out, lse, _ = api.flash_attn_func(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        return_attn_probs=True,
        learnable_sink=s_aux,
    )
    return _returns(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """``flash_attn_func`` on ``qkv (B, S, 3, H, D)``, or on ``qkv (B, S, H + 2 * Hk, D)`` split
    into ``num_heads_q`` query heads and two equal groups of kv heads."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() not in (4, 5):
        raise ValueError(
            "qkv must be a tensor (batch_size, seqlen, 3, nheads, headdim), or (batch_size, seqlen, "
            f"nheads + 2 * nheads_k, headdim) with num_heads_q, got {getattr(qkv, 'shape', type(qkv).__name__)}"
        )
    if qkv.dim() == 5:
        validate.check_packed("qkv", qkv, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
        q, k, v = qkv.unbind(dim=2)
    else:
        heads = validate.check_int("num_heads_q", num_heads_q, 1, "a 4-dim qkv needs the number of query heads")
        kv_heads = (qkv.shape[2] - heads) // 2
        if kv_heads < 1 or heads + 2 * kv_heads != qkv.shape[2]:
            raise ValueError(
                f"qkv has {qkv.shape[2]} heads, which is not num_heads_q ({heads}) plus two equal groups of kv heads"
            )
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        softmax_scale,
        causal,
        None,
        q_descale,
        k_descale,
        v_descale,
        window_size,
        attention_chunk,
        softcap,
        1,
        None,
        deterministic,
        sm_margin,
        return_attn_probs,
        s_aux=s_aux,
    )


def _used_rows(name: str, used, cu: torch.Tensor, rows: int) -> tuple:
    """``(kept, cu_used)``: the rows of a packed tensor of ``rows`` rows with offsets ``cu`` that
    ``used`` (int32 ``(B,)``, at most each sequence's length) keeps, and the offsets of the kept
    rows."""
    batch = cu.numel() - 1
    used = validate.check_index(name, used, (batch,), cu.device)
    lengths = cu[1:] - cu[:-1]
    if validate.on_host(used) and bool(((used < 0) | (used > lengths)).any()):
        raise ValueError(f"{name} must be in [0, the sequence's length] for each sequence, got {used.tolist()}")
    used = torch.minimum(used.clamp(min=0), lengths)  # on a GPU, trusted as flash-attn trusts it, then clamped
    sequence = torch.repeat_interleave(torch.arange(batch, device=cu.device), lengths.long(), output_size=rows)
    position = torch.arange(sequence.numel(), device=cu.device) - cu[sequence]
    kept = torch.nonzero(position < used[sequence]).squeeze(1)
    cu_used = torch.nn.functional.pad(used.cumsum(0), (1, 0)).to(torch.int32)
    return kept, cu_used


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """FA3's attention over packed sequences (module docstring): ``out (total_q, H, D)``, or
    ``(out, softmax_lse (H, total_q))``."""
    _check_fa3_only(qv, q_descale, k_descale, v_descale, attention_chunk, num_splits, pack_gqa, sm_margin)
    q_rows = None
    if seqused_q is not None or seqused_k is not None:  # the rows kept (their offsets read: a synchronisation)
        validate.check_qkv(q, k, v, varlen=True)
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = validate.check_varlen(
            q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
        )
    if seqused_q is not None:
        total_q = q.shape[0]
        q_rows, cu_seqlens_q = _used_rows("seqused_q", seqused_q, cu_seqlens_q, total_q)
        q = q.index_select(0, q_rows)
    if seqused_k is not None:
        k_rows, cu_seqlens_k = _used_rows("seqused_k", seqused_k, cu_seqlens_k, k.shape[0])
        k, v = k.index_select(0, k_rows), v.index_select(0, k_rows)
    out, lse, _ = api.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        return_attn_probs=True,
        learnable_sink=s_aux,
    )
    if q_rows is not None:  # the unused query rows: output 0, lse +inf (a row that sees no key)
        out = out.new_zeros((total_q, *out.shape[1:])).index_copy(0, q_rows, out)
        lse = lse.new_full((lse.shape[0], total_q), float("inf")).index_copy(1, q_rows, lse)
    return _returns(out, lse, return_attn_probs)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
    *,
    s_aux=None,
):
    """FA3's KV-cache attention (module docstring), on flash_recipe's ``flash_attn_with_kvcache``:
    ``out (B, Sq, H, D)``, or ``(out, softmax_lse (B, H, Sq))``."""
    _check_fa3_only(qv, q_descale, k_descale, v_descale, attention_chunk, num_splits, pack_gqa, sm_margin)
    for name, value in (
        ("cu_seqlens_q", cu_seqlens_q),
        ("cu_seqlens_k_new", cu_seqlens_k_new),
        ("max_seqlen_q", max_seqlen_q),
        ("rotary_seqlens", rotary_seqlens),
    ):
        _refuse(name, value, None, "packed queries and new keys over a KV cache are not provided")
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be a torch.Tensor or None, got {type(scheduler_metadata).__name__}")
    return decoding.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table=page_table,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        rotary_interleaved=rotary_interleaved,
        num_splits=max(num_splits, 0),
        return_softmax_lse=return_softmax_lse,
        learnable_sink=s_aux,
    )


def __getattr__(name: str):
    from ..alias import missing  # not at the top, where `missing` would become a name of the stand-in

    raise missing("flash_attn_interface", name, __all__)
