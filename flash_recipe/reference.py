"""Plain-torch attention: the definition every backend is tested against.

Shapes (legend: B batch, Sq/Sk query/key length, H query heads, Hk key/value heads, D head dim,
Dv value head dim)::

    q (B, Sq, H, D)   k (B, Sk, Hk, D)   v (B, Sk, Hk, Dv)   ->   out (B, Sq, H, Dv), lse (B, H, Sq)

Semantics (flash-attn 2.1+): query head ``h`` uses kv head ``h // (H // Hk)``; with ``causal``,
query ``i`` sees key ``j`` iff ``j <= i + diag_offset``; a window ``(left, right)`` limits it to
``[i + diag_offset - left, i + diag_offset + right]``. ``diag_offset = Sk - Sq`` (the default)
aligns the mask bottom-right; for Sq=2, Sk=5::

    1 1 1 1 0
    1 1 1 1 1

``diag_offset = 0`` aligns it top-left, as torch SDPA's ``is_causal``. A row that sees no key
outputs 0 and has ``lse = +inf``, as flash-attn reports it.

Attention sinks ``(H,)``: query head ``h``'s softmax gains the logit ``sinks[h]`` in its
denominator only, ``p_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij))``: the row's weights sum
to less than 1, the lse includes the sink, and a row that sees no key outputs 0 with lse ``sinks[h]``.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    """The precision of the reference: fp32 for fp16/bf16 (fp64 for fp32) when ``upcast``."""
    if not upcast:
        return dtype
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def effective_window(causal: bool, window: tuple) -> tuple[int, int]:
    """The ``(left, right)`` window a call masks with: causal is a window whose right edge is the
    diagonal (``right = 0``); ``-1`` is unbounded on that side."""
    return (window[0], 0) if causal else (window[0], window[1])


def visible_keys(seqlen_q: int, seqlen_k: int, diag_offset: int, window: tuple, device) -> torch.Tensor:
    """Bool ``(Sq, Sk)``: query ``i`` sees key ``j`` iff ``i + diag - left <= j <= i + diag + right``.

    ``window = (left, right)``, ``-1`` meaning unbounded on that side (causal: ``right = 0``).
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    left, right = window
    if right >= 0:
        visible &= j <= i + diag_offset + right
    if left >= 0:
        visible &= j >= i + diag_offset - left
    return visible


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, diag_offset: int) -> torch.Tensor:
    """ALiBi: ``-slope * |i + diag_offset - j|`` as ``(B or 1, H, Sq, Sk)`` float32."""
    i = torch.arange(seqlen_q, device=slopes.device)[:, None]
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (i + diag_offset - j).abs().float()  # (Sq, Sk)
    slopes = slopes.float().reshape(-1 if slopes.dim() == 2 else 1, slopes.shape[-1])  # (B or 1, H)
    return -slopes[:, :, None, None] * distance


def _per_query_head(t: torch.Tensor, nheads: int, dtype: torch.dtype) -> torch.Tensor:
    """``t (B, Sk, Hk, D)`` as ``(B, H, Sk, D)`` in ``dtype``, each kv head repeated for its query heads."""
    return t.to(dtype).transpose(1, 2).repeat_interleave(nheads // t.shape[2], dim=1)


def reference_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    diag_offset: int | None,
    window: tuple,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The logits ``(B, H, Sq, Sk)`` in ``dtype``: ``q k^T * scale``, then the softcap, ALiBi and
    ``attn_mask`` (see ``attention_reference``), ``-inf`` where a key is not visible."""
    seqlen_q, nheads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    seqlen_k = k.shape[1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    qc = q.to(dtype).transpose(1, 2)  # (B, H, Sq, D)
    kc = _per_query_head(k, nheads, dtype)  # (B, H, Sk, D)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    offset = seqlen_k - seqlen_q if diag_offset is None else diag_offset
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, seqlen_q, seqlen_k, offset).to(dtype)
    window = effective_window(causal, window)
    if window != (-1, -1):
        scores = scores.masked_fill(~visible_keys(seqlen_q, seqlen_k, offset, window, q.device), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(dtype)
    return scores


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    diag_offset: int | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    upcast: bool = True,
    window: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    return_probs: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by the textbook formula ``softmax(q k^T * scale + mask) v``.

    Args:
        q, k, v: see the module docstring; any floating dtype.
        softmax_scale: defaults to ``D ** -0.5``.
        causal: apply the causal mask with ``diag_offset`` (default ``Sk - Sq``).
        attn_mask: optional, broadcastable to ``(B, H, Sq, Sk)``; bool (True = attend) or additive.
        dropout_p: dropout on the probabilities (torch's RNG), as torch SDPA applies it.
        window: ``(left, right)`` sliding window around the diagonal, ``-1`` unbounded.
        softcap: > 0 replaces the scaled scores ``s`` by ``softcap * tanh(s / softcap)``.
        alibi_slopes: float32 ``(H,)`` or ``(B, H)``: adds ``-slope * |i + diag_offset - j|``.
        dropout_mask: bool ``(B, H, Sq, Sk)``, the probabilities dropout keeps (with ``dropout_p``);
            without it, dropout draws from torch's RNG.
        return_probs: return the softmax probabilities ``(B, H, Sq, Sk)`` (before dropout) instead of lse.
        sinks: ``(H,)``, each query head's sink logit (see the module docstring); differentiable.
        upcast: compute in fp32 (fp64 for fp32 inputs), the accuracy rule's ground truth; with
            ``upcast=False`` compute in the input dtype, the rule's "PyTorch in the same precision".

    Returns:
        ``out`` in the compute dtype and ``lse (B, H, Sq)`` float32.
    """
    dtype = compute_dtype(q.dtype, upcast)
    scores = reference_scores(q, k, softmax_scale, causal, diag_offset, window, softcap, alibi_slopes, attn_mask, dtype)
    vc = _per_query_head(v, q.shape[2], dtype)  # (B, H, Sk, Dv)
    logits = scores
    if sinks is not None:  # one more logit per row, in the denominator only
        sink_column = sinks.to(dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)  # (B, H, Sq, 1)
        logits = torch.cat([scores, sink_column], dim=-1)
    # Rows that see no key (nor a sink) get lse = +inf and probabilities 0, with finite gradients throughout.
    empty = torch.isneginf(logits).all(dim=-1, keepdim=True)  # (B, H, Sq, 1)
    lse = torch.logsumexp(logits.masked_fill(empty, 0.0), dim=-1, keepdim=True)  # (B, H, Sq, 1)
    lse = lse.masked_fill(empty, float("inf"))
    probs = torch.exp(scores - lse)  # (B, H, Sq, Sk)
    if return_probs:
        lse = probs
    if dropout_p > 0.0:
        if dropout_mask is None:
            probs = torch.nn.functional.dropout(probs, p=dropout_p)
        else:
            probs = probs.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.matmul(probs, vc).transpose(1, 2)  # (B, Sq, H, Dv)
    return out, lse if return_probs else lse.squeeze(-1).float()


def attention_reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    diag_offset: int | None = None,
    window: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2's backward in plain torch: ``dq, dk, dv`` from the saved ``out`` and ``lse``.

    Shapes as ``attention_reference``; ``dout`` and ``out`` ``(B, Sq, H, Dv)``, ``lse (B, H, Sq)``.
    Like the kernels, it does not recompute the softmax's normaliser: the probabilities are
    ``P = exp(scores - lse)`` with the given ``lse``, and ``dS = P * (dout v^T - D)`` with
    ``D = rowsum(dout * out)`` from the given ``out``. With the ``out, lse`` of this attention that
    is its exact gradient; with those of a larger attention of which these keys are one block
    (ring attention's merged result), it is this block's share of that attention's gradients.
    Computed in fp32 (fp64 for fp32 inputs), returned in the dtypes of q, k, v.
    """
    dtype = compute_dtype(q.dtype, True)
    with torch.enable_grad():
        qc, kc, vc = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        scores = reference_scores(
            qc, kc, softmax_scale, causal, diag_offset, window, softcap, alibi_slopes, None, dtype
        )
        probs = torch.exp(scores - lse.detach().to(dtype).unsqueeze(-1))  # (B, H, Sq, Sk); 0 where lse = +inf
        do = dout.detach().to(dtype).transpose(1, 2)  # (B, H, Sq, Dv)
        delta = (do * out.detach().to(dtype).transpose(1, 2)).sum(dim=-1)  # (B, H, Sq)
        # d/dS of <dout, P v> - <D, rowsum P>, with lse held constant, is P * (dout v^T - D).
        objective = (do * torch.matmul(probs, _per_query_head(vc, q.shape[2], dtype))).sum()
        objective = objective - (delta * probs.sum(dim=-1)).sum()
        grads = torch.autograd.grad(objective, (qc, kc, vc))
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rotary embedding computed in ``dtype``: x ``(B, S, H, D)``, cos/sin ``(S_rotary, R / 2)``,
    positions int ``(B, S)``. The first ``R`` dims rotate, in pairs ``(2j, 2j + 1)`` when
    ``interleaved`` and ``(j, j + R / 2)`` otherwise (GPT-NeoX): ``(a, b) -> (a cos - b sin,
    a sin + b cos)``; the rest pass through. Returns ``(B, S, H, D)`` in ``dtype``."""
    half = cos.shape[1]
    c = cos.to(dtype)[positions].unsqueeze(2)  # (B, S, 1, R / 2)
    s = sin.to(dtype)[positions].unsqueeze(2)
    xc = x.to(dtype)
    rot, rest = xc[..., : 2 * half], xc[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of ``x (B, S, H, D)`` at ``positions`` (int ``(B, S)``), computed in fp32
    (see ``rotate``); returns x's dtype."""
    return rotate(x, cos, sin, positions, interleaved, torch.float32).to(x.dtype)
