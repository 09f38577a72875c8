"""``flash_attn.flash_attn_interface.flash_attn_gpu`` of the stand-in: flash-attn 2.8.3's compiled
extension as code that calls it directly sees it (xformers' ``fa2F``/``fa2B`` operators read it
whenever ``flash_attn`` imports).

Its four functions take the extension's positional arguments, in its order, and return its lists;
each runs the stand-in's internal function of the same job (``internal``), so on
flash_recipe's backends:

- ``fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left,
  window_size_right, softcap, return_softmax, gen) -> [out, softmax_lse, S_dmask, rng_state]``;
- ``varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
  alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
  window_size_left, window_size_right, softcap, return_softmax, gen)``, the same list;
- ``bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale,
  is_causal, window_size_left, window_size_right, softcap, deterministic, gen, rng_state) ->
  [dq, dk, dv, softmax_d]``, into ``dq, dk, dv`` where given (else new tensors);
- ``varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
  alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
  window_size_left, window_size_right, softcap, deterministic, gen, rng_state)``, the same list.

Shapes are the internal functions' (their module docstring). ``out`` given to a forward receives
the output. ``zero_tensors`` changes no value that is returned. A ``gen`` (a torch Generator)
is refused: dropout draws from the stand-in's own seed, which ``rng_state`` carries to the
backward; ``seqused_k`` and ``leftpad_k`` are refused as the varlen forward refuses them.
"""

from __future__ import annotations

from typing import Optional

import torch

from .internal import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)


def _no_generator(function: str, gen) -> None:
    if gen is not None:
        raise NotImplementedError(
            f"flash_attn_gpu.{function}: gen must be None: flash_recipe draws dropout from its own seed (the "
            f"rng_state it returns); pass None"
        )


def _into(out: Optional[torch.Tensor], result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
        softcap, return_softmax, gen) -> list:  # fmt: skip
    """The dense forward: ``[out, softmax_lse (B, H, Sq), S_dmask, rng_state]``."""
    _no_generator("fwd", gen)
    result, lse, probs, rng = _flash_attn_forward(
        q, k, v, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
        return_softmax,
    )  # fmt: skip
    return [_into(out, result), lse, probs, rng]


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, gen) -> list:  # fmt: skip
    """The packed forward: ``[out, softmax_lse (H, total_q), S_dmask, rng_state]``."""
    _no_generator("varlen_fwd", gen)
    result, lse, probs, rng = _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k,
        seqused_k,
    )  # fmt: skip
    return [_into(out, result), lse, probs, rng]


def _buffers(q, k, v, dq, dk, dv) -> tuple:
    return tuple(torch.empty_like(like) if given is None else given for given, like in ((dq, q), (dk, k), (dv, v)))


def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, gen, rng_state) -> list:  # fmt: skip
    """The dense backward: ``[dq, dk, dv, softmax_d (B, H, round128(Sq))]``."""
    _no_generator("bwd", gen)
    dq, dk, dv = _buffers(q, k, v, dq, dk, dv)
    softmax_d = _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale, is_causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state,
    )  # fmt: skip
    return [dq, dk, dv, softmax_d]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, deterministic, gen, rng_state) -> list:  # fmt: skip
    """The packed backward: ``[dq, dk, dv, softmax_d (H, total_q + 128 * B)]``."""
    _no_generator("varlen_bwd", gen)
    dq, dk, dv = _buffers(q, k, v, dq, dk, dv)
    softmax_d = _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
        deterministic, rng_state,
    )  # fmt: skip
    return [dq, dk, dv, softmax_d]
