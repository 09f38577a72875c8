"""The Triton kernels as torch custom ops with autograd, so torch.compile traces them whole.

``flash_recipe::attn_fwd`` and ``flash_recipe::attn_bwd`` (the namespace is the package's name,
``_ops.add_op_namespace_prefix``) wrap the launchers in ``forward`` and ``backward``; their fake
implementations give torch.compile the output shapes without running anything. ``attention(q, k, v,
options, varlen)`` is the differentiable entry point the dispatcher uses: an eager call runs the
launchers on its ``ScoreOptions`` directly, and only a call that goes through the ops (under
torch.compile, or with tensor subclasses) is flattened into the ops' flat parameters (``flatten``)
and back (``unflatten``). Both ops' schemas and both directions of the flattening come from one
list, ``OPTION_PARAMS``.

Masking follows flash-attn: query ``i`` sees keys ``[i + diag_offset - window_left, i + diag_offset
+ window_right]``, ``-1`` meaning unbounded on that side (causal is ``window_right = 0``). With
``varlen`` (``cu_seqlens`` int32 ``(B + 1,)``) the tensors are packed ``(total, heads, head_dim)``
and every sequence aligns its diagonal bottom-right. ``options.sinks (H,)``, optional, adds each
query head's sink logit to its softmax's denominator (``forward``); autograd returns its gradient.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

import torch

from .._ops import add_op_namespace_prefix
from .backward_launch import attention_backward
from .forward import attention_forward
from .options import ScoreOptions, Varlen

# The ops' parameters that carry a call's options, in order, with their schema types: the fields of
# ``Varlen`` (None and 0 without packed sequences), then those of ``ScoreOptions``, by name.
OPTION_PARAMS: tuple[tuple[str, str], ...] = (
    ("cu_seqlens_q", "Tensor?"),
    ("cu_seqlens_k", "Tensor?"),
    ("max_seqlen_q", "SymInt"),
    ("max_seqlen_k", "SymInt"),
    ("softmax_scale", "float"),
    ("diag_offset", "SymInt"),
    ("window_left", "SymInt"),
    ("window_right", "SymInt"),
    ("softcap", "float"),
    ("alibi_slopes", "Tensor?"),
    ("dropout_p", "float"),
    ("seed", "Tensor?"),
    ("sinks", "Tensor?"),
)
_NO_VARLEN = (None, None, 0, 0)
_VARLEN_COUNT = len(Varlen._fields)


def flatten(options: ScoreOptions, varlen: Optional[Varlen]) -> tuple:
    """``options`` and ``varlen`` as the ops' flat parameters, in ``OPTION_PARAMS`` order.

    Both are named tuples whose fields are ``OPTION_PARAMS``'s names in order (a test checks), so
    their items are the parameters; plain iteration is what Dynamo traces on every supported torch
    (2.6's cannot trace ``_asdict``).
    """
    return (*(varlen if varlen is not None else _NO_VARLEN), *options)


def unflatten(flat) -> tuple[ScoreOptions, Optional[Varlen]]:
    """The ``ScoreOptions`` and ``Varlen`` (None without packed sequences) of the ops' flat parameters."""
    options = ScoreOptions(*flat[_VARLEN_COUNT:])
    varlen = Varlen(*flat[:_VARLEN_COUNT]) if flat[0] is not None else None
    return options, varlen


def op_schema(tensors: str, flags: str, returns: str) -> str:
    """An op's schema: its leading ``tensors``, the options of ``OPTION_PARAMS``, its ``flags``."""
    options = ", ".join(f"{kind} {name}" for name, kind in OPTION_PARAMS)
    return f"({tensors}, {options}, {flags}) -> {returns}"


def _attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (B, Sq, H, D)``, ``k, v (B, Sk, Hk, D)`` -> ``out (B, Sq, H, D)``, ``lse (B, H, Sq)`` float32.

    Varlen: ``q (total_q, H, D)``, ``k, v (total_k, Hk, D)`` -> ``out (total_q, H, D)``, ``lse (H, total_q)``.
    ``rest``: the flat options, then ``deterministic`` (the backward's path, ``attention_backward``).
    """
    options, varlen = unflatten(rest[:-1])
    return attention_forward(q, k, v, options, varlen)


attn_fwd = torch.library.custom_op(
    add_op_namespace_prefix("attn_fwd"), _attn_fwd, mutates_args=(),
    schema=op_schema("Tensor q, Tensor k, Tensor v", "bool deterministic", "(Tensor, Tensor)"),
)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, *rest):
    if rest[0] is not None:  # cu_seqlens_q: packed sequences
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def _attn_bwd(dout, q, k, v, out, lse, *rest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv, dsink`` (shapes of q, k, v, sinks; ``dsink`` empty without sinks) from
    ``dout`` (shape of q). ``rest``: the flat options, then ``own_lse`` (False when ``out, lse`` may
    be a larger attention's) and ``deterministic`` (``attention_backward``)."""
    *flat, own_lse, deterministic = rest
    options, varlen = unflatten(flat)
    dq, dk, dv, dsink = attention_backward(dout, q, k, v, out, lse, options, varlen, own_lse, deterministic)
    return dq, dk, dv, dsink if dsink is not None else lse.new_empty(0)


attn_bwd = torch.library.custom_op(
    add_op_namespace_prefix("attn_bwd"), _attn_bwd, mutates_args=(),
    schema=op_schema("Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse",
                     "bool own_lse, bool deterministic", "(Tensor, Tensor, Tensor, Tensor)"),
)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, *rest):
    sinks = unflatten(rest[:-2])[0].sinks
    contiguous = torch.contiguous_format
    return (torch.empty_like(q, memory_format=contiguous), torch.empty_like(k, memory_format=contiguous),
            torch.empty_like(v, memory_format=contiguous),
            torch.empty_like(sinks) if sinks is not None else lse.new_empty(0))


def _save(ctx, q, k, v, output, options: ScoreOptions, varlen: Optional[Varlen], deterministic: bool) -> None:
    """Keep what the backward needs: the tensors saved, the rest of the options on ``ctx``."""
    out, lse = output
    cu_q, cu_k = (varlen.cu_seqlens_q, varlen.cu_seqlens_k) if varlen is not None else (None, None)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, options.alibi_slopes, options.seed, options.sinks)
    plain = options.alibi_slopes is None and options.seed is None and options.sinks is None
    ctx.options = options if plain else options._replace(alibi_slopes=None, seed=None, sinks=None)  # tensors saved
    ctx.max_seqlens = (varlen.max_seqlen_q, varlen.max_seqlen_k) if varlen is not None else None
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, eager: bool) -> tuple:
    """``dq, dk, dv`` and the sinks' gradient (None without sinks) of a call ``_save`` kept: through
    the ``attn_bwd`` op (flattened) for the op's own autograd, which torch.compile traces; straight
    through the launcher for an eager call's ``_EagerAttention``."""
    q, k, v, out, lse, cu_q, cu_k, slopes, seed, sinks = ctx.saved_tensors
    plain = slopes is None and seed is None and sinks is None  # ``_save`` kept the options whole
    options = ctx.options if plain else ctx.options._replace(alibi_slopes=slopes, seed=seed, sinks=sinks)
    varlen = Varlen(cu_q, cu_k, *ctx.max_seqlens) if ctx.max_seqlens is not None else None
    if eager and not torch.compiler.is_compiling() and type(dout) is torch.Tensor:
        return attention_backward(dout, q, k, v, out, lse, options, varlen, True, ctx.deterministic)
    dq, dk, dv, dsink = attn_bwd(dout, q, k, v, out, lse, *flatten(options, varlen), True, ctx.deterministic)
    return dq, dk, dv, dsink if sinks is not None else None


def _setup_context(ctx, inputs, output):
    q, k, v, *flat, deterministic = inputs
    options, varlen = unflatten(flat)
    _save(ctx, q, k, v, output, options, varlen, deterministic)


def _backward(ctx, dout, dlse):
    dq, dk, dv, dsink = _gradients(ctx, dout, eager=False)
    # One gradient per op argument: q, k, v, the options (only the sinks have one), deterministic.
    return (dq, dk, dv, *(dsink if name == "sinks" else None for name, _ in OPTION_PARAMS), None)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """``attn_fwd`` with its registered autograd, for eager calls: the same launcher, ``_save`` and
    ``_gradients``, without the custom ops' dispatch and flattening, forward and backward (which
    torch.compile needs and an eager call would pay for on every step). ``sinks`` is
    ``options.sinks``, an argument of its own so that autograd tracks it. A ``forward(ctx, ...)``
    Function, for which torch binds no signature per call (``torch.func`` transforms take neither it
    nor the custom op's autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, varlen, deterministic, signed):
        output = attention_forward(q, k, v, options, varlen, signed=signed)
        _save(ctx, q, k, v, output, options, varlen, deterministic)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv, dsink = _gradients(ctx, dout, eager=True)
        return dq, dk, dv, dsink, None, None, None, None


def _c_apply() -> Optional[tuple]:
    """``(apply, unwrap)``: the C functions ``torch.autograd.Function.apply`` calls outside a functorch
    transform (``torch._C._FunctionBase``'s ``apply``, bound to ``_EagerAttention``, and functorch's
    ``unwrap_if_dead`` for each tensor argument), which ``attention`` calls itself, without that
    method's Python (nine calls for seven arguments); None where this torch lacks either."""
    apply = vars(getattr(torch._C, "_FunctionBase", object)).get("apply")
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    if apply is None or unwrap is None or not hasattr(torch._C, "_are_functorch_transforms_active"):
        return None
    return apply.__get__(None, _EagerAttention), unwrap


_C_APPLY = _c_apply()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: ScoreOptions,
    varlen: Optional[Varlen] = None,
    deterministic: bool = False,
    traced: Optional[bool] = None,
    signed: Optional[Hashable] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention through the Triton kernels; see ``attention_forward`` for shapes.

    ``traced``: whether torch.compile is tracing the call, where the caller knows; None asks
    ``torch.compiler.is_compiling()``. ``signed``: the token of the public call the arguments were
    derived from (``attention_forward``), or None.

    ``options.sinks (H,)`` are differentiable; ``deterministic`` takes the backward's three-kernel
    path, bit-identical from run to run (``attention_backward``). With ``dropout_p > 0`` and no
    ``seed``, the dropout mask's seed is drawn from torch's generator for q's device (so
    ``torch.manual_seed`` makes it reproducible) and kept for the backward, which regenerates the
    same mask.
    """
    if options.dropout_p > 0.0 and options.seed is None:
        options = options._replace(seed=new_seed(q.device))
    sinks = options.sinks
    if traced is None:
        traced = torch.compiler.is_compiling()
    if traced or not (type(q) is type(k) is type(v) is torch.Tensor) or (
        sinks is not None and type(sinks) not in (torch.Tensor, torch.nn.Parameter)  # a model's sinks: a Parameter
    ):
        # Traced whole, as one op; or tensor subclasses (a collective's pending result, for one),
        # which the op's dispatch turns into the plain tensors a launch reads.
        return attn_fwd(q, k, v, *flatten(options, varlen), bool(deterministic))
    if torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    ):
        if _C_APPLY is not None and not torch._C._are_functorch_transforms_active():
            apply, unwrap = _C_APPLY
            sinks = unwrap(sinks) if sinks is not None else None
            return apply(unwrap(q), unwrap(k), unwrap(v), sinks, options, varlen, bool(deterministic), signed)
        return _EagerAttention.apply(q, k, v, sinks, options, varlen, bool(deterministic), signed)
    return attention_forward(q, k, v, options, varlen, signed=signed)  # nothing to record


def new_seed(device: torch.device) -> torch.Tensor:
    """A dropout seed, int64 ``(1,)`` on ``device``, from torch's generator for that device."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
