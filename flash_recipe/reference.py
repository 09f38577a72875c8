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
        upcast: compute in fp32 (fp64 for fp32 inputs), the accuracy rule's ground truth; with
            ``upcast=False`` compute in the input dtype, the rule's "PyTorch in the same precision".

    Returns:
        ``out`` in the compute dtype and ``lse (B, H, Sq)`` float32.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    dtype = compute_dtype(q.dtype, upcast)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = nheads // nheads_k
    qc = q.to(dtype).transpose(1, 2)  # (B, H, Sq, D)
    kc = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, Sk, D)
    vc = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, Sk, Dv)
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
    # Rows that see no key get lse = +inf and probabilities 0, with finite gradients throughout.
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, H, Sq, 1)
    lse = torch.logsumexp(scores.masked_fill(empty, 0.0), dim=-1, keepdim=True)  # (B, H, Sq, 1)
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


def rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of ``x (B, S, H, D)`` at ``positions`` (int ``(B, S)``), in fp32.

    ``cos, sin``: ``(S_rotary, R / 2)``; the first ``R`` dims rotate, in pairs ``(2j, 2j + 1)``
    when ``interleaved`` and ``(j, j + R / 2)`` otherwise (GPT-NeoX); the rest pass through.
    Returns x's dtype.
    """
    half = cos.shape[1]
    c = cos.float()[positions].unsqueeze(2)  # (B, S, 1, R / 2)
    s = sin.float()[positions].unsqueeze(2)
    xf = x.float()
    rot, rest = xf[..., : 2 * half], xf[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, rest), dim=-1).to(x.dtype)
