"""``attn_implementation="recipe_attention"`` for Hugging Face transformers.

Usage::

    import flash_recipe.integrations.transformers as fr_transformers
    fr_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=fr_transformers.ATTN_IMPLEMENTATION)

The name holds no "flash": transformers (5.x) routes every implementation whose name contains
"flash" to its own flash-attn loader, which knows only the flash-attn packages and hub kernels;
likewise "sdpa", "flex", "eager", "paged" and "org/name" patterns mean something to it.

``register()`` adds two entries under the same name: the attention function to transformers'
``AttentionInterface`` and a mask builder to its ``AttentionMaskInterface``. The mask builder hands
the attention function what flash-attn style kernels need: ``None`` when every token is real (the
causal or sliding-window pattern then comes from ``causal`` / ``window_size``), else the 2D
padding mask ``(batch, kv_len)``, True for a real token, which the attention function turns into
packed variable-length sequences (``unpad_input`` -> ``flash_attn_varlen_func`` -> ``pad_input``).

What a model asks for, and what it becomes here (``W`` = the module's ``sliding_window``):

    is_causal (default module.is_causal)   causal=True, bottom-right aligned (a KV cache makes
                                            seqlen_q < seqlen_k; query i sees keys up to
                                            i + seqlen_k - seqlen_q, as in the model's own mask)
    sliding_window=W, causal                window_size=(W - 1, 0): the current token and W - 1 before it
    sliding_window=W, not causal            window_size=(W, W): |i - j| <= W
    softcap=c (Gemma 2 logit softcapping)   softcap=c
    scaling                                 softmax_scale
    dropout (models pass it in training)    dropout_p
    s_aux (attention sinks, gpt-oss: the    learnable_sink on every path below, 4D mask included;
      module's ``sinks``, one per head)       differentiable: the sinks get their gradient
    padding (2D mask with zeros)            varlen over the real tokens; padded query rows output 0
    packed rows (position_ids restarting,   varlen with one sequence per run of consecutive
      no mask, no cache) or cu_seq_lens_*   positions (or the given cu_seq_lens_q / cu_seq_lens_k)
    a 4D mask passed in by the caller       flash_recipe.scaled_dot_product_attention with that mask

Masks that are neither causal, sliding-window nor padding (a model's ``or_mask_function`` /
``and_mask_function``, e.g. bidirectional attention over image tokens, and chunked attention) have
no flash-attn form: building one raises NotImplementedError naming ``attn_implementation="sdpa"``.
Padding in the middle of a sequence (right padding followed by generated tokens) is treated as
absent by the sliding window's count, as in flash-attn: the window counts real tokens.

Under ``torch.compile`` nothing may depend on the data (Dynamo breaks the graph at a
``torch.nonzero`` or a ``bool(tensor)``), so the same requests take shape-static forms:

    every token real, no mask              flash_attn_func, as in eager mode
    a 2D mask (whether or not it holds     the mask is passed on without looking at it; each row
      a zero: that is data)                 is reordered real tokens first (a stable sort), and
                                            one varlen call runs 2 * batch packed sequences: row
                                            b's real tokens and, apart, its pad tokens, whose
                                            output is then set to 0; a backend without varlen
                                            kernels (sdpa, reference) gets one dense call with
                                            the padding folded into its attn_mask instead (its
                                            sliding window counts positions, as the model's own
                                            mask does: different only for padding mid-row)
    packed rows from position_ids          not detected: the number of sequences is data. A row
                                            whose positions restart fails an asynchronous check
                                            (no host sync); pass cu_seq_lens_q / cu_seq_lens_k /
                                            max_length_q / max_length_k instead (on a CPU, the
                                            varlen call checks them on the host: graph breaks)

Neither padded form reads a tensor on the host, so a compiled model runs in one graph
(``fullgraph=True``) with or without padding.

Importing this module does not import transformers; ``register()`` does.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import api, dispatch, validate
from ..padding import pad_input, unpad_input

ATTN_IMPLEMENTATION = "recipe_attention"
# Substrings by which transformers routes an implementation name to its own machinery.
_RESERVED = ("flash", "sdpa", "flex", "eager", "paged", "/", ":", "|")
# The oldest transformers whose AttentionInterface / AttentionMaskInterface this module speaks.
MIN_TRANSFORMERS = "4.53"
_INSTALL_HINT = "pip install 'flash-recipe[transformers]'"


def register(name: str = ATTN_IMPLEMENTATION) -> None:
    """Make ``attn_implementation=name`` (default ``"recipe_attention"``) selectable in transformers.

    Registers ``attention_forward`` in ``transformers.AttentionInterface`` and ``padding_mask`` in
    ``transformers.AttentionMaskInterface``, for every model in the process. Calling it again is
    harmless.

    Raises:
        ImportError: transformers is missing or older than ``MIN_TRANSFORMERS``.
        ValueError: ``name`` is empty, contains one of ``"flash"``, ``"sdpa"``, ``"flex"``,
            ``"eager"``, ``"paged"``, ``"/"``, ``":"``, ``"|"`` (transformers gives those names a
            meaning of its own), or already names another attention implementation.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    reserved = [part for part in _RESERVED if part in name]
    if reserved:
        raise ValueError(
            f"name must not contain {reserved[0]!r} (transformers routes names containing any of {list(_RESERVED)} "
            f"to its own implementations), got {name!r}"
        )
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"flash_recipe.integrations.transformers needs the transformers package; install it with {_INSTALL_HINT}"
        ) from exc
    from packaging.version import Version  # a dependency of transformers

    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        raise ImportError(
            f"transformers must be >= {MIN_TRANSFORMERS} for attn_implementation={name!r}, "
            f"got {transformers.__version__}; upgrade with {_INSTALL_HINT}"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for interface, function in ((AttentionInterface, attention_forward), (AttentionMaskInterface, padding_mask)):
        current = interface._global_mapping.get(name)
        if current is not None and current is not function:
            raise ValueError(
                f"name must not be an attention implementation transformers already has, got {name!r} "
                f"(registered to {getattr(current, '__qualname__', current)!r} in {interface.__name__})"
            )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


def padding_mask(*, kv_length: int, attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
    """The mask builder transformers calls for this implementation (``AttentionMaskInterface``).

    Arguments (keywords, as transformers passes them; the others, such as ``batch_size`` and
    ``mask_function``, describe the causal or sliding pattern, which the kernels apply themselves):
        kv_length: the number of keys the layer attends to.
        attention_mask: bool ``(batch_size, seen_tokens + q_length)``, True for a real token, or None.
        use_vmap (in kwargs): True when the model combined its mask with custom mask functions.
        config (in kwargs): the model config.

    Returns:
        None if every one of the last ``kv_length`` tokens is real, else the bool padding mask
        ``(batch_size, kv_len)`` of the last ``kv_length`` tokens (shorter than ``kv_length``
        only when a static cache holds empty slots after them).
    """
    if kwargs.get("use_vmap"):
        raise NotImplementedError(
            "the model combines its causal mask with custom mask functions (or_mask_function / and_mask_function, "
            "e.g. bidirectional attention over image tokens), which flash_recipe cannot express (it takes causal, "
            "sliding-window and padding masks); load the model with attn_implementation='sdpa'"
        )
    config = kwargs.get("config")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None:
        raise NotImplementedError(
            f"chunked attention (config.attention_chunk_size={chunk}) is not supported by flash_recipe; "
            "load the model with attn_implementation='sdpa'"
        )
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if _static_shapes():  # whether every token is real is data: the attention function takes both
        return attention_mask
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _static_shapes() -> bool:
    """Whether torch.compile is tracing: then no shape or branch may depend on a tensor's values."""
    return torch.compiler.is_compiling()


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _indices(mask: torch.Tensor):
    """``indices (total,)``, ``cu_seqlens (batch + 1,)`` int32, ``max_seqlen`` of a bool ``(batch, seqlen)`` mask."""
    _, indices, cu_seqlens, max_seqlen, _ = unpad_input(mask.unsqueeze(-1), mask)
    return indices, cu_seqlens, max_seqlen


def _gather(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Tokens ``indices`` (into the flattened ``batch * seqlen``) of ``x (batch, seqlen, heads, dim)``,
    a strided view, as ``(total, heads, dim)``: one copy, with no contiguous copy before it."""
    seqlen = x.shape[1]
    return x[indices // seqlen, indices % seqlen]


def _packed_runs(position_ids, batch: int, seqlen: int) -> Optional[torch.Tensor]:
    """cu_seqlens of the runs of consecutive positions in ``position_ids (1 or batch, seqlen)``, or
    None when every row is one run (nothing packed)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != seqlen:
        return None
    if position_ids.shape[0] not in (1, batch) or seqlen < 2:
        return None
    position_ids = position_ids.expand(batch, -1)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    first = torch.nonzero(starts.flatten()).flatten()
    if first.numel() == batch:
        return None
    total = torch.tensor([batch * seqlen], device=first.device)
    return torch.cat([first, total]).to(torch.int32)


_RESTART_MESSAGE = (
    "position_ids restart within a row (packed sequences), which flash_recipe cannot detect under "
    "torch.compile without a host sync; pass cu_seq_lens_q, cu_seq_lens_k, max_length_q and max_length_k "
    "(transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) does), or run the model uncompiled"
)


def _check_one_run_per_row(position_ids, batch: int, seqlen: int) -> None:
    """Under torch.compile: fail, asynchronously (no host sync), where ``position_ids`` restart in a
    row, since the packed form that eager mode gives them needs their number on the host."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != seqlen:
        return
    if position_ids.shape[0] not in (1, batch) or seqlen < 2:
        return
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    torch._assert_async((steps == 1).all(), _RESTART_MESSAGE)


def _real_first(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape-static packing of a bool ``(batch, seqlen)`` mask, True for a real token.

    Returns ``order (batch * seqlen,)`` int64, the flattened token indices with each row's real
    tokens first and then its pad tokens (each in their order), and ``cu_seqlens (2 * batch + 1,)``
    int32: in ``order``, packed sequence ``2b`` is row ``b``'s real tokens, ``2b + 1`` its pad
    tokens. Row ``[pad, a, pad, b]`` becomes ``[a, b | pad, pad]``, sequences 2 and 2.
    """
    batch, seqlen = mask.shape
    rows = torch.arange(batch, device=mask.device)
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True) + rows[:, None] * seqlen
    real_end = rows * seqlen + mask.sum(dim=1)
    row_end = (rows + 1) * seqlen
    cu_seqlens = torch.cat([rows.new_zeros(1), torch.stack([real_end, row_end], dim=1).flatten()])
    return order.flatten(), cu_seqlens.to(torch.int32)


def _attend_padded_static(q, k, v, mask_q, mask_k, options: dict) -> torch.Tensor:
    """Padded attention with shape-static tensors only (for torch.compile): ``out (batch,
    seqlen_q, nheads, headdim)``, 0 at padded queries.

    ``q (batch, seqlen_q, nheads, headdim)``, ``k, v (batch, seqlen_k, nheads_k, headdim)``;
    ``mask_q (batch, seqlen_q)`` and ``mask_k (batch, seqlen_k)`` bool, True for a real token;
    the queries are the last ``seqlen_q`` keys (causal) or any queries (cross-attention).

    The backend that would run the packed form decides: one with varlen kernels runs it (see
    ``_real_first``: the real tokens of a row attend among themselves exactly as the eager path's
    ``unpad_input`` packing has them, the pad tokens among themselves); any other backend gets one
    dense call whose attn_mask hides the pad keys from real queries. A pad query there sees the
    pad keys instead, so that no row is empty (some torch SDPA kernels give NaN for a row that sees
    no key, and the backward would carry it into the real rows' gradients); its output is set to 0
    in both forms.
    """
    validate.check_qkv(q, k, v)
    batch, seqlen_q, _, head_dim = q.shape
    seqlen_k = k.shape[1]
    causal = validate.check_bool("causal", options["causal"])
    score = dict(
        softmax_scale=validate.check_scale(options["softmax_scale"], head_dim),
        causal=causal,
        window=validate.check_window(causal, options["window_size"]),
        softcap=validate.check_softcap(options["softcap"]),
        dropout_p=validate.check_dropout(options["dropout_p"]),
        sinks=options["learnable_sink"],
    )
    order_q, cu_q = _real_first(mask_q)
    order_k, cu_k = _real_first(mask_k)
    packed = dispatch.AttentionCall(
        q=_gather(q, order_q),
        k=_gather(k, order_k),
        v=_gather(v, order_k),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=seqlen_q,
        max_seqlen_k=seqlen_k,
        **score,
    )
    backend = dispatch.select(packed)
    if backend.native_varlen:
        out = backend.run_call(packed)[0]
        inverse = torch.empty_like(order_q).scatter_(0, order_q, torch.arange(order_q.numel(), device=q.device))
        out = out.index_select(0, inverse).view(batch, seqlen_q, *out.shape[1:])
    else:
        visible = mask_k[:, None, None, :] | ~mask_q[:, None, :, None]  # (batch, 1, seqlen_q, seqlen_k)
        dense = dispatch.AttentionCall(q=q, k=k, v=v, diag_offset=seqlen_k - seqlen_q, attn_mask=visible, **score)
        out = dispatch.run(dense)[0]
    return out.masked_fill(~mask_q[:, :, None, None], 0.0)


def _attend_4d_mask(query, key, value, attention_mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention under a 4D mask the caller built (``attention_forward``'s layout in, flash-attn's
    out): SDPA's semantics, on flash_recipe's ``scaled_dot_product_attention``."""
    if options["window_size"] != (-1, -1) or options["softcap"]:
        raise NotImplementedError(
            "a 4D attention_mask cannot be combined with sliding_window or softcap in flash_recipe; "
            "pass a 2D padding mask or use attn_implementation='sdpa'"
        )
    out = api.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=options["dropout_p"],
        scale=options["softmax_scale"],
        enable_gqa=query.shape[1] != key.shape[1],
        learnable_sink=options["learnable_sink"],
    )
    return out.transpose(1, 2)


def _attend_padded(q, k, v, mask: torch.Tensor, causal: bool, options: dict) -> torch.Tensor:
    """Attention over padded rows, ``mask (batch, kv_len)`` True where a token is: the tokens
    packed as varlen sequences (under torch.compile's static shapes, ``_attend_padded_static``),
    the output padded back with zeros. q ``(batch, seqlen_q, nheads, headdim)``, k and v in the same
    layout; a static cache's slots past the mask are dropped, and the queries of a causal call with
    ``seqlen_q < seqlen_k`` are the last ``seqlen_q`` tokens (cross-attention masks the keys only)."""
    batch, seqlen_q = q.shape[:2]
    if mask.shape[1] < k.shape[1]:  # a static cache: slots after the mask are empty
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    mask = mask[:, -k.shape[1] :]
    seqlen_k = k.shape[1]
    if _static_shapes():
        if seqlen_q == seqlen_k:
            mask_q = mask
        elif causal and seqlen_q < seqlen_k:  # the queries are the last seqlen_q tokens
            mask_q = mask[:, -seqlen_q:]
        else:  # cross-attention: the mask covers the keys only
            mask_q = mask.new_ones(batch, seqlen_q)
        return _attend_padded_static(q, k, v, mask_q, mask, options)
    indices_k, cu_k, max_k = _indices(mask)
    if seqlen_q == seqlen_k:
        indices_q, cu_q, max_q = indices_k, cu_k, max_k
    elif causal and seqlen_q < seqlen_k:  # the queries are the last seqlen_q tokens
        indices_q, cu_q, max_q = _indices(mask[:, -seqlen_q:])
    else:  # cross-attention: the mask covers the keys only
        indices_q, cu_q, max_q = _indices(mask.new_ones(batch, seqlen_q))
    out = api.flash_attn_varlen_func(
        _gather(q, indices_q), _gather(k, indices_k), _gather(v, indices_k), cu_q, cu_k, max_q, max_k, **options
    )
    return pad_input(out, indices_q, batch, seqlen_q)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for this implementation (``AttentionInterface``).

    Arguments:
        module: the attention layer (its ``is_causal`` is the default for ``is_causal``).
        query: ``(batch, nheads, seqlen_q, headdim)``.
        key, value: ``(batch, nheads_k, seqlen_k, headdim)``, ``nheads % nheads_k == 0`` (GQA:
            query heads map to kv heads in contiguous groups); with a KV cache
            ``seqlen_k >= seqlen_q`` and the queries are the last ``seqlen_q`` positions.
        attention_mask: from ``padding_mask``: None or bool ``(batch, kv_len)``; or a 4D mask the
            caller built, broadcastable to ``(batch, nheads, seqlen_q, seqlen_k)``.
        dropout: dropout probability on the attention weights (models pass their
            ``attention_dropout`` in training and 0.0 in evaluation).
        scaling: softmax scale; default ``1 / sqrt(headdim)``.
        sliding_window: ``W``: a causal query sees itself and ``W - 1`` keys before it.
        softcap: logit softcapping (scores become ``softcap * tanh(scores / softcap)``).
        is_causal: overrides ``module.is_causal``.
        kwargs: ``position_ids (batch or 1, seqlen)`` (packed rows when positions restart and there
            is no mask), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``
            (packed rows given explicitly); ``s_aux``: attention sinks ``(nheads,)``, one logit per
            query head (gpt-oss passes its ``sinks`` parameter), which joins each row's softmax
            denominator and no value: ``p_ij = exp(s_ij) / (exp(s_aux[h]) + sum_j exp(s_ij))``;
            differentiable. ``output_attentions=True`` is not supported (NotImplementedError).

    Returns:
        ``(out, None)``: ``out (batch, seqlen_q, nheads, headdim)``; padded query rows are 0.
        No attention weights (as flash-attn, they are never materialised).
    """
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "output_attentions=True is not supported by flash_recipe: as in flash-attn, the attention weights are "
            "never materialised; load the model with attn_implementation='eager' to get them"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = validate.check_sinks(sinks, query.shape[1], query.device, name="s_aux")
    options = dict(
        dropout_p=float(dropout),
        softmax_scale=scaling,
        causal=causal,
        window_size=_window(sliding_window, causal),
        softcap=float(softcap) if softcap else 0.0,
        learnable_sink=sinks,
    )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        return _attend_4d_mask(query, key, value, attention_mask, options), None
    # flash-attn layout (batch, seqlen, heads, dim) as views: no copy.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    batch, seqlen_q, nheads, _ = q.shape
    if attention_mask is not None:
        return _attend_padded(q, k, v, attention_mask.bool(), causal, options), None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if all(x is not None for x in (cu_q, cu_k, max_q, max_k)):
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q, max_k = int(max_q), int(max_k)
    elif seqlen_q == k.shape[1] and _static_shapes():
        _check_one_run_per_row(kwargs.get("position_ids"), batch, seqlen_q)
        cu_q = None
    elif seqlen_q == k.shape[1]:
        cu_q = cu_k = _packed_runs(kwargs.get("position_ids"), batch, seqlen_q)
        if cu_q is not None:
            max_q = max_k = int((cu_q[1:] - cu_q[:-1]).max())
    else:
        cu_q = None
    if cu_q is not None:
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        out = api.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)
        return out.view(batch, -1, nheads, out.shape[-1]), None

    return api.flash_attn_func(q, k, v, **options), None
