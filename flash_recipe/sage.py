"""8-bit attention for inference, behind SageAttention's API: ``sageattn``, ``sageattn_varlen`` and
the path-named functions diffusers imports (``SAGE_NAMES``).

The method (thu-ml's SageAttention and SageAttention2; ``flash_recipe.reference_int8`` defines it):
K smoothed by its mean over tokens, Q and K quantized to INT8 with one scale per block of rows,
Q.K^T on integer tensor cores, the forward's online softmax, and P.V in fp16, or in FP8 e4m3 on
GPUs with FP8 tensor cores (sm89 and newer), accumulated in fp32. It trades a little accuracy for
speed (docs/int8-attention.md gives the measured metrics); it is forward only: to train, use
``flash_attn_func``.

Shapes (``tensor_layout``; legend: B batch, H query heads, Hk key/value heads, S length, D head
dim)::

    "HND": q (B, H, Sq, D), k, v (B, Hk, Sk, D)  -> out (B, H, Sq, D)
    "NHD": q (B, Sq, H, D), k, v (B, Sk, Hk, D)  -> out (B, Sq, H, D)
    lse (with return_lse): (B, H, Sq) float32, natural log

Query head ``h`` reads key/value head ``h // (H // Hk)``. ``is_causal`` aligns the diagonal
bottom-right (query ``i`` of ``Sq`` sees key ``j`` iff ``j <= i + Sk - Sq``)::

    Sq = 2, Sk = 4:  1 1 1 0
                     1 1 1 1

Where Triton cannot run (no Triton, a GPU older than sm80, the CPU without ``TRITON_INTERPRET=1``)
the same method runs in plain torch (``reference_int8.sage_attention``, 64-row blocks): the same
results to rounding, far slower.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import reference_int8, validate
from ._ops import add_op_namespace_prefix
from .dispatch import capabilities

# The names ``import sageattention`` gives (diffusers 0.42 imports all of them).
SAGE_NAMES = (
    "sageattn",
    "sageattn_varlen",
    "sageattn_qk_int8_pv_fp16_triton",
    "sageattn_qk_int8_pv_fp16_cuda",
    "sageattn_qk_int8_pv_fp8_cuda",
    "sageattn_qk_int8_pv_fp8_cuda_sm90",
)
LAYOUTS = ("HND", "NHD")
PV_DTYPES = ("fp16", "fp8")
# SageAttention's keyword arguments, by the values flash_recipe implements (any other is refused).
_ACCEPTED = {
    "pv_accum_dtype": ("fp32",),  # P.V accumulates in fp32 on every path
    "smooth_v": (False,),  # V is not smoothed (its per-channel scale keeps FP8 in range)
    "quantization_backend": ("triton",),  # Q and K are quantized by a Triton kernel
    "attn_mask": (None,),  # no mask (ComfyUI passes attn_mask=None on every call)
    "dropout_p": (0.0,),  # no dropout: inference
}
_REFUSED = {
    "qk_quant_gran": "flash_recipe quantizes Q and K with one scale per block of rows (its tiles), not per warp or "
    "per thread",
}
TRAINING = "8-bit attention is for inference (forward only); to train, use flash_recipe.flash_attn_func"


def _check_kwargs(name: str, kwargs: dict) -> bool:
    """``smooth_k`` (default True) from SageAttention's keyword arguments; refuse what is not implemented."""
    smooth_k = validate.check_bool("smooth_k", kwargs.pop("smooth_k", True))
    for key, value in kwargs.items():
        if key in _REFUSED:
            raise NotImplementedError(f"{name}: {key}={value!r} is not implemented: {_REFUSED[key]}; omit {key}")
        allowed = _ACCEPTED.get(key)
        if key == "attn_mask" and value is not None:
            raise NotImplementedError(
                f"{name}: attn_mask must be None: 8-bit attention takes no mask (is_causal "
                f"masks causally); for a mask use flash_recipe.scaled_dot_product_attention"
            )
        if allowed is None:
            raise TypeError(
                f"{name} got an unexpected keyword argument {key!r}; it takes smooth_k and "
                f"{', '.join(sorted(_ACCEPTED))} (flash_recipe implements no other)"
            )
        if value is not None and value not in allowed or value is None and None not in allowed:
            raise NotImplementedError(
                f"{name}: {key} must be {' or '.join(map(repr, allowed))} in flash_recipe, got {value!r}; omit {key}"
            )
    return smooth_k


def _check_inputs(q, k, v, varlen: bool) -> tuple:
    names = ("q", "k", "v")
    validate.check_qkv(q, k, v, names, varlen=varlen)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"q must have dtype float16 or bfloat16 for 8-bit attention, got {q.dtype}; "
            f"fix: q.to(torch.float16) (and k, v)"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(f"q, k and v must not require grad: {TRAINING} (or call under torch.no_grad())")
    return validate.last_dim_contiguous(names, (q, k, v))


def triton_problem(q: torch.Tensor) -> Optional[str]:
    """Why the 8-bit Triton kernels cannot run on ``q``'s device (None: they can)."""
    error = capabilities.import_error("triton")
    if error is not None:
        return error
    problem = capabilities.triton_too_old()
    if problem is not None:
        return problem
    if q.device.type == "cpu":
        return capabilities.interpreter_problem()
    if q.device.type != "cuda":
        return f"device type {q.device.type!r} is not supported (cuda or, with the interpreter, cpu)"
    if torch.version.hip is None:
        major, minor = capabilities.device_capability(q.device)
        if major < 8:
            return capabilities.pre_ampere_reason(major, minor)
    return None


def _pv_fp8(q: torch.Tensor, pv_dtype: Optional[str], name: str) -> bool:
    """Whether P.V runs in FP8: ``pv_dtype`` ("fp16", "fp8", checked by ``_attend``), or None for
    the GPU's fastest."""
    if q.device.type != "cuda" or triton_problem(q) is not None:
        if pv_dtype == "fp8":
            raise NotImplementedError(
                f"{name}: FP8 P.V runs on NVIDIA GPUs of sm89 or newer through Triton; "
                f"use pv_dtype='fp16' (sageattn_qk_int8_pv_fp16_triton)"
            )
        return False
    from .ops.int8_attention import fp8_problem  # imports Triton: on a GPU call only
    from .ops.targets import target_of  # beside it: the ops package loads on first use

    problem = fp8_problem(target_of(q.device))
    if pv_dtype == "fp8" and problem is not None:
        raise NotImplementedError(f"{name}: {problem} (sageattn_qk_int8_pv_fp16_triton)")
    return pv_dtype == "fp8" or pv_dtype is None and problem is None


def _run(q, k, v, scale: float, causal: bool, smooth_k: bool, fp8: bool, need_lse: bool, varlen: tuple = ()):
    """The kernels, or the torch definition where Triton cannot run; ``(out, lse or None)``."""
    if triton_problem(q) is None:
        from .ops.int8_attention import int8_attention  # imports Triton: on the first call only

        packed = dict(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), varlen))
        return int8_attention(q, k, v, scale, causal, smooth_k, fp8, need_lse=need_lse, **packed)
    out, lse = reference_int8.sage_attention(q, k, v, scale, causal, smooth_k, fp8, 64, 64, *varlen)
    return out, lse if need_lse else None


def _attend(name, q, k, v, scale, causal, smooth_k, pv_dtype, need_lse, varlen: tuple = ()):
    """P.V's format for this device, then the kernels (``_run``): ``(out, lse or None)``. Under
    torch.compile through the op ``int8_attn``, which Dynamo does not trace into (the kernels'
    launch path and the device checks are not traceable), eagerly without it."""
    if pv_dtype is not None and pv_dtype not in PV_DTYPES:
        raise ValueError(f"{name}: pv_dtype must be one of {PV_DTYPES} or None, got {pv_dtype!r}")
    if torch.compiler.is_compiling():
        cu_q, cu_k, max_q, max_k = varlen or (None, None, 0, 0)
        out, lse = int8_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, smooth_k, pv_dtype or "", need_lse, name)
        return out, lse if need_lse else None
    return _run(q, k, v, scale, causal, smooth_k, _pv_fp8(q, pv_dtype, name), need_lse, varlen)


def _int8_attn(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, smooth_k, pv_dtype, need_lse, name
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body, run eagerly where the compiled graph calls it: P.V's format for the device,
    then ``_run``; ``pv_dtype`` "" for None, and an empty lse unless ``need_lse``."""
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) if cu_seqlens_q is not None else ()
    out, lse = _run(q, k, v, scale, causal, smooth_k, _pv_fp8(q, pv_dtype or None, name), need_lse, varlen)
    return out.contiguous(), lse.contiguous() if lse is not None else q.new_empty(0, dtype=torch.float32)


int8_attn = torch.library.custom_op(
    add_op_namespace_prefix("int8_attn"),
    _int8_attn,
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float scale, bool causal, bool smooth_k, str pv_dtype, bool need_lse, str name) "
    "-> (Tensor, Tensor)",
)


@int8_attn.register_fake
def _int8_attn_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *rest):
    """``out`` shaped as q and ``lse (B, H, Sq)`` float32 where asked for (dense only), both contiguous."""
    need_lse = rest[4]
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if need_lse and cu_seqlens_q is None else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _sage(name: str, q, k, v, tensor_layout, is_causal, sm_scale, return_lse, pv_dtype, kwargs) -> Any:
    smooth_k = _check_kwargs(name, kwargs)
    if tensor_layout not in LAYOUTS:
        raise ValueError(
            f"{name}: tensor_layout must be 'HND' (batch, heads, seqlen, headdim) or 'NHD' "
            f"(batch, seqlen, heads, headdim), got {tensor_layout!r}"
        )
    for t in (q, k, v):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(f"{name}: q, k and v must have 4 dimensions ({tensor_layout}), got shape {tuple(t.shape)}")
    if tensor_layout == "HND":  # the kernels read strides: a view, no copy
        q, k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    q, k, v = _check_inputs(q, k, v, varlen=False)
    causal = validate.check_bool("is_causal", is_causal)
    need_lse = validate.check_bool("return_lse", return_lse)
    scale = validate.check_scale(sm_scale, q.shape[-1], "sm_scale")
    out, lse = _attend(name, q, k, v, scale, causal, smooth_k, pv_dtype, need_lse)
    if tensor_layout == "HND":
        out = out.transpose(1, 2)
    return (out, lse) if need_lse else out


def sageattn(
    q,
    k,
    v,
    tensor_layout: str = "HND",
    is_causal: bool = False,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    **kwargs,
) -> Any:
    """8-bit attention, P.V in FP8 where the GPU has FP8 tensor cores, else fp16.

    Arguments:
        q, k, v: fp16 or bf16, shaped by ``tensor_layout`` (module docstring); k and v alike.
        tensor_layout: "HND" or "NHD".
        is_causal: bottom-right causal mask.
        sm_scale: the softmax scale; None gives ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp ``(B, H, Sq)`` float32 (+inf for a row that sees
            no key).
        kwargs: ``smooth_k`` (default True: subtract K's mean before quantizing);
            ``pv_accum_dtype="fp32"``, ``smooth_v=False`` and ``quantization_backend="triton"``
            are what flash_recipe does and are accepted; ``pv_dtype`` ("fp16" or "fp8") picks P.V's
            format. Any other argument or value is refused by name.

    Returns:
        ``out`` like q (or ``(out, lse)``).
    """
    pv_dtype = kwargs.pop("pv_dtype", None)
    return _sage("sageattn", q, k, v, tensor_layout, is_causal, sm_scale, return_lse, pv_dtype, kwargs)


def _fixed_pv(name: str, pv_dtype: str, doc: str) -> Any:
    """``sageattn`` under one of SageAttention's path names, its P.V format fixed to ``pv_dtype``."""

    def path(
        q,
        k,
        v,
        tensor_layout: str = "HND",
        is_causal: bool = False,
        sm_scale: Optional[float] = None,
        return_lse: bool = False,
        **kwargs,
    ) -> Any:
        return _sage(name, q, k, v, tensor_layout, is_causal, sm_scale, return_lse, pv_dtype, kwargs)

    path.__name__ = path.__qualname__ = name
    path.__doc__ = doc
    return path


sageattn_qk_int8_pv_fp16_triton = _fixed_pv(
    "sageattn_qk_int8_pv_fp16_triton", "fp16", "``sageattn`` with P.V in fp16 on every GPU."
)
sageattn_qk_int8_pv_fp16_cuda = _fixed_pv(
    "sageattn_qk_int8_pv_fp16_cuda",
    "fp16",
    "``sageattn`` with P.V in fp16: SageAttention's CUDA path of that name, here on the Triton kernels.",
)
sageattn_qk_int8_pv_fp8_cuda = _fixed_pv(
    "sageattn_qk_int8_pv_fp8_cuda",
    "fp8",
    "``sageattn`` with P.V in FP8 e4m3: NVIDIA sm89 and newer; elsewhere refused with the fix.",
)
sageattn_qk_int8_pv_fp8_cuda_sm90 = _fixed_pv(
    "sageattn_qk_int8_pv_fp8_cuda_sm90",
    "fp8",
    "``sageattn_qk_int8_pv_fp8_cuda`` (SageAttention's Hopper build of it; one kernel serves here).",
)


def sageattn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    is_causal: bool = False,
    sm_scale: Optional[float] = None,
    smooth_k: bool = True,
    **kwargs,
) -> torch.Tensor:
    """8-bit attention over packed sequences: q ``(total_q, H, D)``, k, v ``(total_k, Hk, D)``,
    sequence ``b`` in rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (int32, ``(B + 1,)``) and likewise
    for keys; each sequence gets its own K mean, its own quantization blocks and its own
    bottom-right diagonal. Returns out ``(total_q, H, D)``. Keyword arguments as ``sageattn``."""
    name = "sageattn_varlen"
    pv_dtype = kwargs.pop("pv_dtype", None)
    smooth = _check_kwargs(name, dict(kwargs, smooth_k=smooth_k))
    q, k, v = _check_inputs(q, k, v, varlen=True)
    varlen = validate.check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    causal = validate.check_bool("is_causal", is_causal)
    scale = validate.check_scale(sm_scale, q.shape[-1], "sm_scale")
    out, _ = _attend(name, q, k, v, scale, causal, smooth, pv_dtype, False, varlen)
    return out
