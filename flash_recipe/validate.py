"""Argument checks shared by the public entry points (``api`` and ``kvcache``).

Each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
with a message that names the argument and what it may be, and returns the value in the form the
layers below take (a Python int or float, a contiguous metadata tensor, a view with a usable
stride). Nothing here knows about backends.

Layouts (B batch, Sq/Sk query/key length, H query heads, Hk key/value heads, D head dim)::

    dense    q (B, Sq, H, D)    k (B, Sk, Hk, D)    v (B, Sk, Hk, Dv)
    varlen   q (total_q, H, D)  k (total_k, Hk, D)  v (total_k, Hk, Dv)   cu_seqlens int32 (B + 1,)
    paged    k, v (num_blocks, page_block_size, Hk, D)                     block_table int32 (B, width)
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
PAGE_MULTIPLE = 16  # page sizes must be multiples of this (the smallest key block)
MAX_INT32 = 2**31 - 1  # lengths, windows and offsets reach the kernels as int32, as in flash-attn
FLASH_LAYOUT = "(batch, seqlen, nheads, headdim)"
SDPA_LAYOUT = "(batch, nheads, seqlen, headdim)"
LAYOUT_HINT = (
    "; flash_attn_func takes q, k, v as (batch, seqlen, nheads, headdim): tensors in "
    "(batch, nheads, seqlen, headdim) go to flash_recipe.scaled_dot_product_attention, or pass q.transpose(1, 2)"
)


def on_host(t: torch.Tensor) -> bool:
    """Whether the checks read the values of metadata tensor ``t`` (offsets, lengths, page indices).

    Only host memory is read: reading a GPU tensor's values would synchronise the device on every
    call and could not be captured in a CUDA graph, so there the kernels bound every access instead.
    Nor under torch.compile, whose traced tensors have no values yet (a read would be a
    data-dependent guard); the kernels bound the accesses there too. The one place this decision
    is made."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _dtype_fix(name: str) -> str:
    return f"; fix: {name}.to(torch.float16), {name}.to(torch.bfloat16) or {name}.to(torch.float32)"


def check_tensor(name: str, t, ndim: int, layout: str) -> None:
    """``t`` is a float16/bfloat16/float32 tensor with ``ndim`` dimensions (``layout`` names them)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {t.dtype}" + _dtype_fix(name))
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")


def check_packed(name: str, t, dim: int, count: int, layout: str) -> None:
    """A packed ``qkv``/``kv`` tensor: ``layout`` with size ``count`` in dimension ``dim``."""
    check_tensor(name, t, len(layout.split(",")), layout)
    if t.shape[dim] != count:
        raise ValueError(f"{name} must have size {count} in dimension {dim} {layout}, got shape {tuple(t.shape)}")


def check_qkv(
    q, k, v, names=("q", "k", "v"), same_v_dim: bool = True, varlen: bool = False, same_batch: bool = True
) -> None:
    """Shapes ``q (B, Sq, H, D)``, ``k (B, Sk, Hk, D)``, ``v (B, Sk, Hk, Dv)`` (varlen: without
    the batch dim, ``(total, heads, headdim)``; a KV cache: ``same_batch=False``); raise on mismatch.

    A dense call whose shapes would agree read as ``(B, H, S, D)`` (SDPA's layout) says so: the
    usual cause is SDPA-layout tensors passed to ``flash_attn_func``."""
    qn, kn, vn = names
    layout = "(total_tokens, nheads, headdim)" if varlen else FLASH_LAYOUT
    for name, t in zip(names, (q, k, v)):
        check_tensor(name, t, 3 if varlen else 4, layout)
    check_same_kind(names, (q, k, v))
    if varlen:  # views with a batch dim of 1, so the checks below read the same
        q, k, v = (t.unsqueeze(0) for t in (q, k, v))
    hint = "" if varlen or not same_batch or not _fits_sdpa_layout(q, k, v, same_v_dim) else LAYOUT_HINT
    for name, t in ((kn, k), (vn, v)):
        if same_batch and t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must have the same batch size as {qn} ({q.shape[0]}), got {t.shape[0]}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        what = "total tokens and nheads" if varlen else "seqlen and nheads"
        raise ValueError(
            f"{vn} must have the same {what} as {kn} {tuple(k.shape[1:3])}, got {tuple(v.shape[1:3])}" + hint
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{kn} must have the same head dim as {qn} ({q.shape[3]}), got {k.shape[3]}")
    if same_v_dim and v.shape[3] != q.shape[3]:
        raise ValueError(f"{vn} must have the same head dim as {qn} ({q.shape[3]}), got {v.shape[3]}")
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"the number of query heads ({nheads}) must be a multiple of the number of key/value heads of {kn}, "
            f"got {nheads_k}" + hint
        )
    check_head_dim(qn, q.shape[3])


def check_same_kind(names, tensors) -> None:
    """Every tensor after the first has the first's dtype and device (the message gives the fix)."""
    first, first_name = tensors[0], names[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} must have the same dtype as {first_name} ({first.dtype}), got {t.dtype}; "
                f"fix: {name}.to({first_name}.dtype)"
            )
        if t.device != first.device:
            raise ValueError(
                f"{name} must be on the same device as {first_name} ({first.device}), got {t.device}; "
                f"fix: {name}.to({first_name}.device)"
            )


def check_head_dim(name: str, head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name} must have a head dim (last dimension) between 1 and {MAX_HEAD_DIM}, got {head_dim}")


def _fits_sdpa_layout(q, k, v, same_v_dim: bool) -> bool:
    """Whether 4-dim ``q, k, v`` agree when read as ``(B, H, S, D)``."""
    return (
        k.shape[0] == v.shape[0] == q.shape[0]
        and k.shape[1:3] == v.shape[1:3]
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
        and k.shape[3] == q.shape[3]
        and (not same_v_dim or v.shape[3] == q.shape[3])
    )


def check_sdpa(query, key, value, enable_gqa: bool) -> None:
    """``query (B, H, Sq, D)``, ``key (B, Hk, Sk, D)``, ``value (B, Hk, Sk, Dv)`` (or all without
    the batch dim), checked in SDPA's layout: the messages give the shapes as passed."""
    names = ("query", "key", "value")
    tensors = (query, key, value)
    for name, t in zip(names, tensors):
        if isinstance(t, torch.Tensor) and t.dim() == 3:
            check_tensor(name, t, 3, "(nheads, seqlen, headdim)")
        else:
            check_tensor(name, t, 4, SDPA_LAYOUT)
    if len({t.dim() for t in tensors}) != 1:
        raise ValueError(
            f"query, key and value must all have 4 dimensions {SDPA_LAYOUT} or all 3, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_same_kind(names, tensors)
    shapes = {name: tuple(t.shape) for name, t in zip(names, tensors)}
    full = tuple(t if t.dim() == 4 else t.unsqueeze(0) for t in tensors)
    (b, h, sq, d), (bk, hk, sk, dk), (bv, hv, sv, _) = (t.shape for t in full)
    layout = SDPA_LAYOUT if query.dim() == 4 else "(nheads, seqlen, headdim)"
    if bk != b or bv != b:
        name = "key" if bk != b else "value"
        raise ValueError(f"{name} must have the batch size of query {shapes['query']} {layout}, got {shapes[name]}")
    if (hv, sv) != (hk, sk):
        raise ValueError(
            f"value must have the nheads and seqlen of key {shapes['key']} {layout}, got {shapes['value']}"
        )
    if dk != d:
        raise ValueError(f"key must have the head dim of query {shapes['query']} {layout}, got {shapes['key']}")
    if not enable_gqa and hk != h:
        raise ValueError(
            f"key must have as many heads as query {shapes['query']} {layout} unless enable_gqa=True, "
            f"got {shapes['key']}; fix: enable_gqa=True, or repeat key and value's heads"
        )
    if hk == 0 or h % hk != 0:
        raise ValueError(f"key must have a number of heads that divides query's ({h}) {layout}, got {shapes['key']}")
    check_head_dim("query", d)
    check_scores(("query", "key"), b, h, sq, sk, query.dtype)


def max_scores(dtype: torch.dtype) -> int:
    """The most attention scores (``batch * nheads * seqlen_q * seqlen_k``) one call may have with
    inputs of ``dtype``. The torch backends (SDPA's math kernel, the reference) hold the scores as
    one tensor, in float32 for 16-bit inputs and float64 for float32 (the reference's precision), and
    torch sizes no tensor of ``2**63`` bytes or more: a larger call fails there with "Storage size
    calculation overflowed". One bound for every backend, so that they all take the same calls (the
    Triton kernels never hold the scores, but count dropout offsets over them in int64)."""
    return (2**63 - 1) // (8 if dtype == torch.float32 else 4)


def check_scores(names, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dtype: torch.dtype) -> None:
    """The attention matrix of a dense call, ``batch * nheads * seqlen_q * seqlen_k`` scores, is within
    ``max_scores``; ``names`` are the query's and the key's (the tensors whose shapes give it).
    Shapes only: this costs nothing and reads no tensor."""
    scores = batch * nheads * seqlen_q * seqlen_k
    limit = max_scores(dtype)
    if scores > limit:
        qn, kn = names
        held = "float64, 8 bytes" if dtype == torch.float32 else "float32, 4 bytes"
        raise ValueError(
            f"{qn} and {kn} make an attention matrix of batch * nheads * seqlen_q * seqlen_k = "
            f"{batch} * {nheads} * {seqlen_q} * {seqlen_k} = {scores} scores; a call may have at most {limit} "
            f"with {dtype} inputs, whose scores the torch backends hold in {held} each, and torch sizes no "
            f"tensor of 2**63 bytes; fix: split the call into several over slices of the batch (or of the "
            f"query rows)"
        )


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, viewed with last-dim stride 1 when that dim has size 1: its stride is then never
    used, and torch counts such a tensor as contiguous whatever it is (``x.transpose(-1, -2)`` of
    an ``(..., 1, n)`` tensor), but the kernels and the checks read the stride. Any other tensor is
    returned as it is."""
    if t.shape[-1] == 1 and t.stride(-1) != 1:
        return t.as_strided(t.shape, t.stride()[:-1] + (1,), t.storage_offset())
    return t


def last_dim_contiguous(names, tensors) -> tuple:
    """The tensors (None passes through) through ``unit_last_stride``; raise naming the first whose
    last dimension still has a stride other than 1."""
    tensors = tuple(None if t is None else unit_last_stride(t) for t in tensors)
    for name, t in zip(names, tensors):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}; "
                f"fix: {name}.contiguous()"
            )
    return tensors


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_scale(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    """The softmax scale as a float; None gives ``1 / sqrt(head_dim)``."""
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{name} must be a finite number or None (1 / sqrt(headdim)), got {softmax_scale}")
    return float(softmax_scale)


def check_dropout(dropout_p, name: str = "dropout_p") -> float:
    """A dropout probability in [0, 1), as a float."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:  # NaN fails this too
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_alibi(slopes, batch: int, nheads: int, device) -> None:
    """ALiBi slopes: float32 ``(nheads,)`` or ``(batch, nheads)`` on ``device``, last dim contiguous."""
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


SINK_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_sinks(sinks, nheads: int, device, name: str = "learnable_sink") -> torch.Tensor:
    """Attention sinks: a float ``(nheads,)`` tensor on ``device``, one logit per query head. Returns
    it contiguous (a strided view is copied; the copy passes the gradient back)."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in SINK_DTYPES:
        allowed = ", ".join(str(d) for d in SINK_DTYPES)
        raise TypeError(f"{name} must be a floating tensor ({allowed}), got {sinks.dtype}; fix: {name}.float()")
    if tuple(sinks.shape) != (nheads,):
        raise ValueError(
            f"{name} must have shape (nheads,) = ({nheads},): one sink logit per query head, got {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(
            f"{name} must be on the same device as q ({device}), got {sinks.device}; fix: {name}.to(q.device)"
        )
    return sinks if sinks.stride(0) == 1 or nheads <= 1 else sinks.contiguous()


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


def check_int(
    name: str, value, minimum: Optional[int] = None, meaning: str = "", maximum: Optional[int] = MAX_INT32
) -> int:
    """``value`` as a Python int (see ``is_int``), in ``[minimum, maximum]`` (by default at most
    int32's largest, as the kernels take it); raise naming ``name``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{f' ({meaning})' if meaning else ''}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def check_window(causal, window_size) -> tuple[int, int]:
    """The ``(left, right)`` window as given, -1 meaning unbounded (``AttentionCall`` sets
    ``right = 0`` when causal).

    ``window_size`` is any pair of ints (see ``is_int``): a tuple or list, a 2-element integer
    tensor or numpy array, as flash-attn's own tests pass it.
    """
    check_bool("causal", causal)
    try:
        pair = list(window_size) if getattr(window_size, "ndim", 1) == 1 else None
    except TypeError:
        pair = None
    if pair is None or len(pair) != 2 or not all(is_int(w) for w in pair):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (operator.index(w) for w in pair)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be -1 (unbounded) or >= 0, got {(left, right)}")
    if max(left, right) > MAX_INT32:
        raise ValueError(f"window_size entries must be at most {MAX_INT32} (or -1, unbounded), got {(left, right)}")
    return left, right


def check_softcap(softcap) -> float:
    """A finite softcap >= 0 (0 disables it), as a float."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not (0.0 <= softcap < math.inf):  # NaN fails this too
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    return float(softcap)


def check_offsets(name: str, cu, total: Optional[int], device) -> torch.Tensor:
    """Validate one ``cu_seqlens`` tensor (``total``: the rows it must end at, None unchecked) and
    return it contiguous: the kernels read offsets with stride 1, so a strided view is copied
    (it holds batch + 1 ints)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}; fix: {name}.to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(
            f"{name} must be on the same device as q ({device}), got {cu.device}; fix: {name}.to(q.device)"
        )
    cu = cu.contiguous()
    if on_host(cu):
        values = cu.tolist()
        if (
            values[0] != 0
            or values[-1] != (values[-1] if total is None else total)
            or any(b < a for a, b in zip(values, values[1:]))
        ):
            end = "" if total is None else f" to the total number of tokens ({total})"
            raise ValueError(f"{name} must rise from 0{end} without decreasing, got {values}")
    return cu


def check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """Validate packed-sequence offsets (``k`` None: paged keys, whose total is not checked) and
    ``max_seqlen_q/k`` (ints up to int32's largest, lowered to the packed tensors' totals). Their
    values are read only for CPU tensors: on a GPU that would cost a synchronisation per call, so
    there (as in flash-attn) they are trusted, and the kernels clamp them to the packed tensors."""
    cu_seqlens_q = check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_seqlens_k = check_offsets("cu_seqlens_k", cu_seqlens_k, None if k is None else k.shape[0], q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_k must have as many entries as cu_seqlens_q ({cu_seqlens_q.numel()}), "
            f"got {cu_seqlens_k.numel()}"
        )
    max_seqlen_q, max_seqlen_k = check_int("max_seqlen_q", max_seqlen_q, 0), check_int("max_seqlen_k", max_seqlen_k, 0)
    for name, value, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        if on_host(cu):
            longest = max(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:]))
            if value < longest:
                raise ValueError(f"{name} must be at least the longest sequence ({longest}), got {value}")
    # The grid is sized from these: no sequence is longer than the packed tensor that holds it.
    max_seqlen_q = min(max_seqlen_q, q.shape[0])
    if k is not None:
        max_seqlen_k = min(max_seqlen_k, k.shape[0])
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k


def check_index(name: str, t, shape: tuple, device) -> torch.Tensor:
    """Check an int32 metadata tensor and return it contiguous (a copy only when it is a strided view)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}; fix: {name}.to(torch.int32)")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {t.device}; fix: {name}.to(q.device)")
    return t.contiguous()


def check_block_table(block_table, batch: int, page_size: int, device, pages: str) -> torch.Tensor:
    """An int32 ``block_table (batch, width)``, returned contiguous, for pages of ``page_size`` rows
    (``pages`` names the paged tensor's dimension), which must be a multiple of ``PAGE_MULTIPLE``."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table must be an int32 tensor (batch_size, max_num_blocks_per_seq)")
    block_table = check_index("block_table", block_table, (batch, block_table.shape[1]), device)
    if page_size % PAGE_MULTIPLE != 0:
        raise ValueError(
            f"the page size ({pages} with a block_table) must be a multiple of {PAGE_MULTIPLE}, got {page_size}"
        )
    return block_table


def check_pages(name: str, table: torch.Tensor, num_pages: int, page_size: int, starts, ends) -> None:
    """Every page that rows ``[starts[b], ends[b])`` touch must exist (CPU values only)."""
    if not on_host(table):
        return
    rows = table.tolist()
    for b, (lo, hi) in enumerate(zip(starts, ends)):
        if hi <= lo:
            continue
        used = rows[b][lo // page_size : (hi - 1) // page_size + 1]
        bad = [p for p in used if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"{name}[{b}] holds page indices {bad} outside [0, {num_pages}) (num_blocks)")


def check_rotary(rotary_cos, rotary_sin, q, k, head_dim: int) -> None:
    """Rotary tables ``(seqlen_ro, rotary_dim / 2)`` in q's dtype or float32, for new keys ``k``."""
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {tuple(t.shape)}")
        if t.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have q's dtype ({q.dtype}) or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(
            f"rotary_sin must have the shape of rotary_cos {tuple(rotary_cos.shape)}, got {tuple(rotary_sin.shape)}"
        )
    if not 1 <= 2 * rotary_cos.shape[1] <= head_dim:
        raise ValueError(
            f"rotary_dim (2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]}) must be in [2, headdim = {head_dim}]"
        )
    if k is None:
        raise ValueError("rotary_cos and rotary_sin rotate the new keys: pass k and v with them")
