"""Public attention functions: flash-attn 2's ``flash_attn_*`` family and torch's SDPA signature.

This is the only layer that validates input and fills in defaults; it builds an
``AttentionCall`` and hands it to ``flash_recipe.dispatch``, which picks the backend.
"""

from __future__ import annotations

import numbers
import operator
from typing import Optional

import torch

from flash_recipe import dispatch
from flash_recipe.dispatch import AttentionCall

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")


def _check_qkv(q, k, v, names=("q", "k", "v"), same_v_dim: bool = True, varlen: bool = False,
               same_batch: bool = True) -> None:
    """Shapes ``q (B, Sq, H, D)``, ``k (B, Sk, Hk, D)``, ``v (B, Sk, Hk, Dv)`` (varlen: without
    the batch dim, ``(total, heads, headdim)``; a KV cache: ``same_batch=False``); raise on mismatch."""
    qn, kn, vn = names
    layout = "(total_tokens, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)"
    for name, t in zip(names, (q, k, v)):
        _check_tensor(name, t, 3 if varlen else 4, layout)
    if varlen:  # views with a batch dim of 1, so the checks below read the same
        q, k, v = (t.unsqueeze(0) for t in (q, k, v))
    for name, t in ((kn, k), (vn, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as {qn} ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as {qn} ({q.device}), got {t.device}")
        if same_batch and t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must have the same batch size as {qn} ({q.shape[0]}), got {t.shape[0]}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        what = "total tokens and nheads" if varlen else "seqlen and nheads"
        raise ValueError(f"{vn} must have the same {what} as {kn} {tuple(k.shape[1:3])}, got {tuple(v.shape[1:3])}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{kn} must have the same head dim as {qn} ({q.shape[3]}), got {k.shape[3]}")
    if same_v_dim and v.shape[3] != q.shape[3]:
        raise ValueError(f"{vn} must have the same head dim as {qn} ({q.shape[3]}), got {v.shape[3]}")
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"the number of query heads ({nheads}) must be a multiple of the number of key/value heads, "
            f"got {nheads_k}"
        )
    head_dim = q.shape[3]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, viewed with last-dim stride 1 when that dim has size 1: its stride is then never
    used, and torch counts such a tensor as contiguous whatever it is (``x.transpose(-1, -2)`` of
    an ``(..., 1, n)`` tensor), but the kernels and the checks read the stride. Any other tensor is
    returned as it is."""
    if t.shape[-1] == 1 and t.stride(-1) != 1:
        return t.as_strided(t.shape, t.stride()[:-1] + (1,), t.storage_offset())
    return t


def _check_scale(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


def _check_dropout(dropout_p, name: str = "dropout_p") -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def _check_alibi(slopes, batch: int, nheads: int, device) -> None:
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads}), "
            f"got {tuple(slopes.shape)}"
        )
    if slopes.device != device:
        raise ValueError(f"alibi_slopes must be on the same device as q ({device}), got {slopes.device}")
    if slopes.stride(-1) != 1:
        raise ValueError(f"alibi_slopes must have a contiguous last dimension, got stride {slopes.stride(-1)}")


def is_int(value) -> bool:
    """Whether ``value`` is an integer as flash-attn takes one: anything usable as an index (a
    Python or numpy int, a 0-dim integer tensor), but not a bool."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_int(name: str, value, minimum: Optional[int] = None, meaning: str = "") -> int:
    """``value`` as a Python int (see ``is_int``), at least ``minimum``; raise naming ``name``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{f' ({meaning})' if meaning else ''}, got {value}")
    return value


def check_window(causal, window_size) -> tuple[int, int]:
    """The ``(left, right)`` window, with ``right = 0`` when causal; -1 is unbounded.

    ``window_size`` is any pair of ints (see ``is_int``): a tuple or list, a 2-element integer
    tensor or numpy array, as flash-attn's own tests pass it.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    try:
        pair = list(window_size) if getattr(window_size, "ndim", 1) == 1 else None
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2 or not all(is_int(w) for w in pair):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (operator.index(w) for w in pair)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be -1 (unbounded) or >= 0, got {(left, right)}")
    return left, 0 if causal else right  # causal is a window whose right edge is the diagonal


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if softcap < 0.0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    return float(softcap)


def _build_flash_call(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
    return_lse, names=("q", "k", "v"), varlen: Optional[tuple] = None, paged: bool = False,
) -> AttentionCall:
    """Validate flash-attn style arguments and build the call.

    ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` for packed sequences;
    with ``paged`` the keys and values are pages ``(num_blocks, page_block_size, nheads_k, headdim)``.
    """
    if paged:
        layout = "(num_blocks, page_block_size, nheads_k, headdim)"
        for name, t in zip(names[1:], (k, v)):
            _check_tensor(name, t, 4, layout)
        if k.shape != v.shape or k.shape[0] == 0:
            raise ValueError(f"{names[2]} must have the shape of {names[1]} {layout} with at least one block, "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        _check_qkv(q, k[0], v[0], names, varlen=True)
    else:
        _check_qkv(q, k, v, names, varlen=varlen is not None)
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    for name, t in zip(names, (q, k, v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}")
    dropout_p = _check_dropout(dropout_p)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    (left, right), softcap = check_window(causal, window_size), check_softcap(softcap)
    batch = q.shape[0]
    if varlen is not None:
        varlen = _check_varlen(q, None if paged else k, *varlen)
        batch = varlen[0].numel() - 1
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, batch, q.shape[-2], q.device)
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    return AttentionCall(
        q=q, k=k, v=v,
        softmax_scale=_check_scale(softmax_scale, q.shape[-1]),
        causal=causal,
        diag_offset=0 if varlen is not None else k.shape[1] - q.shape[1],
        window=(left, right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        return_lse=bool(return_lse),
        dropout_p=dropout_p,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
    )


def _check_offsets(name: str, cu, total: Optional[int], device) -> torch.Tensor:
    """Validate one ``cu_seqlens`` tensor (``total``: the rows it must end at, None unchecked) and
    return it contiguous: the kernels read offsets with stride 1, so a strided view is copied
    (it holds batch + 1 ints)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {cu.device}")
    cu = cu.contiguous()
    if cu.device.type == "cpu":
        values = cu.tolist()
        if values[0] != 0 or values[-1] != (values[-1] if total is None else total) or any(
            b < a for a, b in zip(values, values[1:])
        ):
            end = "" if total is None else f" to the total number of tokens ({total})"
            raise ValueError(f"{name} must rise from 0{end} without decreasing, got {values}")
    return cu


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """Validate packed-sequence offsets (``k`` None: paged keys, whose total is not checked). Their
    values are read only for CPU tensors: on a GPU that would cost a synchronisation per call, so
    there (as in flash-attn) they are trusted, and the kernels clamp them to the packed tensors."""
    cu_seqlens_q = _check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_seqlens_k = _check_offsets("cu_seqlens_k", cu_seqlens_k, None if k is None else k.shape[0], q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_k must have as many entries as cu_seqlens_q ({cu_seqlens_q.numel()}), got {cu_seqlens_k.numel()}"
        )
    max_seqlen_q, max_seqlen_k = check_int("max_seqlen_q", max_seqlen_q, 0), check_int("max_seqlen_k", max_seqlen_k, 0)
    for name, value, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        if cu.device.type == "cpu":
            longest = max(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:]))
            if value < longest:
                raise ValueError(f"{name} must be at least the longest sequence ({longest}), got {value}")
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k


def _finish(result, return_attn_probs):
    out, lse, s_dmask = result
    if return_attn_probs:
        # flash-attn returns (out, softmax_lse, S_dmask); S_dmask exists only with dropout.
        return out, lse, s_dmask
    return out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention with flash-attn 2's signature and semantics.

    Arguments:
        q: ``(batch_size, seqlen_q, nheads, headdim)``
        k, v: ``(batch_size, seqlen_k, nheads_k, headdim)``; ``nheads % nheads_k == 0`` (MQA/GQA):
            query heads map to kv heads in contiguous groups, e.g. with 6 query heads and 2 kv
            heads, query heads 0, 1, 2 use kv head 0 and 3, 4, 5 use kv head 1.
        dropout_p: dropout probability on the attention weights (pass 0.0 in evaluation). The mask
            is counter-based, from a seed drawn from torch's generator for q's device, so
            ``torch.manual_seed`` reproduces it and the backward regenerates it.
        softmax_scale: scaling of ``q @ k^T`` before the softmax; default ``1 / sqrt(headdim)``.
        causal: causal mask aligned to the bottom-right corner. With seqlen_q = 2 and seqlen_k = 5::

                1 1 1 1 0
                1 1 1 1 1

            and with seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A row that sees no key outputs 0 (and gets zero gradients).
        window_size: ``(left, right)``: query ``i`` sees keys
            ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``; -1 is unbounded
            on that side; ``causal`` sets ``right = 0``. Key blocks outside every row's window are
            skipped, so the work scales with the window. Any pair of ints (a 2-element integer
            tensor too). An entry ``>= seqlen_k`` keeps this meaning (flash-attn's kernels make it
            -1; README: "Where flash-attn's code and docstring disagree").
        softcap: > 0 turns the scores into ``softcap * tanh(scores / softcap)`` (Gemma 2); 0 disables.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch_size, nheads)``; adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the score of query ``i`` and key ``j``
            (after the softcap), with or without ``causal`` (the lse is that of these scores).
        deterministic: accepted; the backward of the Triton kernels is always deterministic.
        return_attn_probs: also return the log-sum-exp and, with dropout, the attention
            probabilities ``(batch_size, nheads, seqlen_q, seqlen_k)``, negative where dropped
            (testing only).

    Dtypes: float16, bfloat16 and float32 (fp32 is computed in full fp32, never TF32). The last
    dim of q, k, v must be contiguous; other strides are free, so views of packed tensors work.

    Returns:
        out: ``(batch_size, seqlen_q, nheads, headdim)``.
        With ``return_attn_probs``: ``(out, softmax_lse, None)`` where ``softmax_lse`` is
        ``(batch_size, nheads, seqlen_q)`` float32, the natural-log log-sum-exp of each row of
        ``q @ k^T * softmax_scale`` (``+inf`` for a row that sees no key).
    """
    call = _build_flash_call(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )
    return _finish(dispatch.run(call), return_attn_probs)


def _check_packed(name: str, t, count: int, layout: str) -> None:
    _check_tensor(name, t, 5, layout)
    if t.shape[2] != count:
        raise ValueError(f"{name} must have size {count} in dimension 2 {layout}, got shape {tuple(t.shape)}")


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_func`` on a packed ``qkv (batch_size, seqlen, 3, nheads, headdim)``.

    q, k and v are strided views of ``qkv`` (no copy); the gradient flows back into ``qkv``.
    Returns ``out (batch_size, seqlen, nheads, headdim)``, or ``(out, softmax_lse, None)``.
    """
    _check_packed("qkv", qkv, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=2)
    call = _build_flash_call(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_func`` with ``q (batch_size, seqlen_q, nheads, headdim)`` and a packed
    ``kv (batch_size, seqlen_k, 2, nheads_k, headdim)``; ``nheads % nheads_k == 0``.

    Returns ``out (batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse, None)``.
    """
    _check_packed("kv", kv, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=2)
    call = _build_flash_call(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, names=("q", "kv[:, :, 0]", "kv[:, :, 1]"),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
):
    """``flash_attn_func`` over a batch of packed sequences of different lengths.

    Arguments:
        q: ``(total_q, nheads, headdim)``, the sequences one after another; k, v:
            ``(total_k, nheads_k, headdim)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch_size + 1,)``; sequence ``b`` is rows
            ``cu_seqlens[b]:cu_seqlens[b + 1]``. Sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: the longest sequence on each side.
        The rest as ``flash_attn_func``; each sequence aligns its causal mask and window
        bottom-right with its own lengths; ``alibi_slopes`` may be ``(batch_size, nheads)``.
        block_table: optional int32 ``(batch_size, max_num_blocks_per_seq)``: k and v are then a
            paged cache ``(num_blocks, page_block_size, nheads_k, headdim)`` (page size a multiple
            of 16), sequence ``b``'s key ``j`` is in page ``block_table[b, j // page_block_size]``
            and ``cu_seqlens_k`` gives only the lengths. Forward only (inference).

    Returns:
        ``out (total_q, nheads, headdim)``, or ``(out, softmax_lse, None)`` with ``softmax_lse``
        ``(nheads, total_q)`` float32.
    """
    call = _build_flash_call(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        paged=block_table is not None,
    )
    if block_table is not None:
        from flash_recipe.kvcache import paged_varlen

        return _finish(paged_varlen(call, block_table), return_attn_probs)
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_varlen_func`` on a packed ``qkv (total, 3, nheads, headdim)`` (views, no copy)."""
    _check_tensor("qkv", qkv, 4, "(total_tokens, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have size 3 in dimension 1 (total_tokens, 3, nheads, headdim), got shape {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=1)
    call = _build_flash_call(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"),
        varlen=(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn_varlen_func`` with ``q (total_q, nheads, headdim)`` and a packed
    ``kv (total_k, 2, nheads_k, headdim)``."""
    _check_tensor("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have size 2 in dimension 1 (total_k, 2, nheads_k, headdim), got shape {tuple(kv.shape)}")
    k, v = kv.unbind(dim=1)
    call = _build_flash_call(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, names=("q", "kv[:, 0]", "kv[:, 1]"),
        varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )
    return _finish(dispatch.run(call), return_attn_probs)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Arguments:
        query: ``(batch, nheads, seqlen_q, headdim)`` (or without the batch dim).
        key: ``(batch, nheads_k, seqlen_k, headdim)``; value: ``(batch, nheads_k, seqlen_k, headdim_v)``.
            ``nheads_k`` must equal ``nheads`` unless ``enable_gqa``, which allows any divisor.
        attn_mask: bool (True = attend) or additive float mask broadcastable to
            ``(batch, nheads, seqlen_q, seqlen_k)``; cannot be combined with ``is_causal``.
        dropout_p: dropout probability, applied as torch applies it (always, not only in training).
        is_causal: causal mask aligned to the top-left corner, as torch defines it: query ``i``
            sees keys ``0..i``.
        scale: defaults to ``1 / sqrt(headdim)``.

    Returns:
        ``(batch, nheads, seqlen_q, headdim_v)``, a view in torch's layout. Calls without an
        ``attn_mask`` run on the Triton kernels where they can (a GPU, or the CPU through the
        interpreter); the rest go to torch. Dropout on the Triton kernels draws its own
        counter-based mask (reproducible under ``torch.manual_seed``, as ``flash_attn_func``'s),
        not the one torch's kernels would draw; ``use_backend("sdpa")`` gives torch's.
    """
    names = ("query", "key", "value")
    tensors = (query, key, value)
    for name, t in zip(names, tensors):
        if isinstance(t, torch.Tensor) and t.dim() == 3:
            continue
        _check_tensor(name, t, 4, "(batch, nheads, seqlen, headdim)")
    unbatched = all(t.dim() == 3 for t in tensors)
    if unbatched:
        query, key, value = (t.unsqueeze(0) for t in tensors)
    # flash layout views; a non-contiguous last dim is copied, as torch itself would.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = (unit_last_stride(t if t.stride(-1) == 1 else t.contiguous()) for t in (q, k, v))
    _check_qkv(q, k, v, names, same_v_dim=False)
    if not enable_gqa and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"key must have as many heads as query ({q.shape[2]}) unless enable_gqa=True, got {k.shape[2]}"
        )
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be used together")
        if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
            raise TypeError(f"attn_mask must be bool or have the query's dtype ({q.dtype}), got {attn_mask.dtype}")
    call = AttentionCall(
        q=q, k=k, v=v,
        softmax_scale=_check_scale(scale, q.shape[-1], name="scale"),
        causal=bool(is_causal),
        diag_offset=0,
        attn_mask=attn_mask,
        dropout_p=_check_dropout(dropout_p),
    )
    out = dispatch.run(call)[0].transpose(1, 2)
    return out.squeeze(0) if unbatched else out


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> dict[str, Optional[str]]:
    """Which backends can run ``flash_attn_func(q, k, v, **kwargs)``, and why the others cannot.

    Returns a dict in priority order: backend name -> None (it can run the call) or the reason.
    The backend that would run is the first with None, unless one is chosen explicitly.
    """
    options = dict(
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False,
    )
    unknown = set(kwargs) - set(options)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {sorted(unknown)}; allowed: {sorted(options)}")
    options.update(kwargs)
    call = _build_flash_call(
        q, k, v, options["dropout_p"], options["softmax_scale"], options["causal"], options["window_size"],
        options["softcap"], options["alibi_slopes"], options["deterministic"], options["return_attn_probs"],
    )
    return dispatch.explain_call(call)
