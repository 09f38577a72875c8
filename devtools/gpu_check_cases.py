"""The correctness step's cases and the check of one (``devtools.gpu_check`` runs them).

Each check runs one call on the ``triton`` backend and compares its output and its gradients
``dq, dk, dv`` with the truth (``flash_recipe.testing``: the reference in fp32, fp64 for fp32
inputs) by the accuracy rule of ``flash_recipe.testing.accuracy``: at most 2x (output) or 3x
(gradients) the error of a low-precision peer against the same truth, plus the rule's floor. The
peer is PyTorch computing the same attention in the input dtype: SDPA's flash kernel where it can
run the case (CUDA, fp16/bf16, no window, softcap, ALiBi or dropout, a causal mask only where
Sq == Sk, as its ``is_causal`` aligns top-left), else torch math in the input dtype (the
reference with ``upcast=False``); each row names its peer and, beside SDPA's bounds, the bounds
torch math would give.

The table (``GPU_TABLE`` on a GPU, ``TINY_TABLE`` for the interpreter) has one ``Case`` per row, so
a new feature is one more row (and its option in ``Case.options``). Kinds, with their shapes
(B batch, Sq/Sk query/key length, H/Hk query/kv heads, D head dim):

- ``dense``: ``flash_attn_func(q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, D))``, forward and
  backward; query head ``h`` uses kv head ``h // (H // Hk)``;
- ``varlen``: ``flash_attn_varlen_func`` over sequences of lengths ``lens_q[b]`` / ``lens_k[b]``
  packed as ``(sum lens, H, D)``, forward and backward; the truth attends sequence by sequence;
- ``dropout``: ``flash_attn_func`` with ``dropout_p``, checked by its own replay: the same seed run
  again with ``return_attn_probs=True`` gives the kept entries (``>= 0``), and the reference with
  that mask is the truth; the kept fraction of the visible entries must be within 6 standard
  deviations of ``1 - dropout_p``;
- ``kvcache``: ``flash_attn_with_kvcache`` appending ``new`` rows to a (paged) cache holding
  ``cache[b]`` rows of ``Sk``, forward only, by ``verify_kvcache.check_kvcache_case`` (its oracle
  rebuilds each entry's cache; the written rows must be exact, the rest untouched).

A row with ``sink`` gives every query head an attention sink (``sink + linspace(-1, 1, H)`` in the
input dtype, as a model holds them): a leaf like q, k and v, whose gradient ``dsink`` is checked as
theirs; SDPA has no sinks, so such rows take torch math as their peer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_recipe.api import flash_attn_func, flash_attn_varlen_func
from flash_recipe.decoding import flash_attn_with_kvcache
from flash_recipe.dispatch import use_backend
from flash_recipe.testing import FACTORS, accuracy_bound, attention, compute_dtype, max_error
from flash_recipe.tools.sizes import Sizes
from flash_recipe.tools.verify_kvcache import KVCase, check_kvcache_case, kv_inputs

KINDS = ("dense", "varlen", "dropout", "kvcache")
GRADIENTS = ("dq", "dk", "dv")
GPU_DTYPES = ("bfloat16", "float16")
INTERPRETER_DTYPES = ("float16", "float32")
KEPT_SIGMAS = 6.0


@dataclasses.dataclass(frozen=True)
class Case(Sizes):
    """One row: a call of ``kind`` (default ``"dense"``; see the module docstring for the shapes of
    each kind) on its sizes (``Sizes``).

    ``lens_q``/``lens_k``: varlen sequence lengths (``batch`` of each); ``cache``: kvcache rows
    already filled per entry, ``seqlen_k`` its capacity, ``new`` rows appended, ``page`` > 0 its
    page size. ``alibi``: slopes per batch entry and head ``(B, H)``.
    """

    kind: str = "dense"
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    dropout: float = 0.0
    lens_q: tuple = ()
    lens_k: tuple = ()
    cache: tuple = ()
    new: int = 0
    page: int = 0
    sink: Optional[float] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "varlen" and not (len(self.lens_q) == len(self.lens_k) == self.batch):
            raise ValueError(f"varlen needs {self.batch} lengths each side, got {self.lens_q} and {self.lens_k}")

    @property
    def id(self) -> str:
        extras = [
            f"win{self.window[0]}_{self.window[1]}" if self.window != (-1, -1) else "",
            f"cap{self.softcap:g}" if self.softcap else "",
            "alibi" if self.alibi else "",
            f"drop{self.dropout:g}" if self.dropout else "",
            f"new{self.new}-page{self.page}" if self.kind == "kvcache" else "",
            f"sink{self.sink:g}" if self.sink is not None else "",
        ]
        return "-".join([self.kind, self.sizes_id, "causal" if self.causal else "full", *filter(None, extras)])

    @property
    def features(self) -> list:
        """What the row covers, for the report's summary."""
        names = [self.heads, f"D{self.head_dim}"]
        names += ["causal"] if self.causal else []
        names += ["Sq!=Sk"] if self.seqlen_q != self.seqlen_k and self.kind != "kvcache" else []
        names += {"varlen": ["varlen"], "dropout": ["dropout"], "kvcache": ["KV cache"]}.get(self.kind, [])
        names += ["paged"] if self.page else []
        names += ["append"] if self.new else []
        names += ["window"] if self.window != (-1, -1) else []
        names += ["softcap"] if self.softcap else []
        names += ["ALiBi"] if self.alibi else []
        names += ["sinks"] if self.sink is not None else []
        return names

    def sinks(self, dtype, device) -> tuple:
        """``()``, or ``(sinks,)``: the row's attention sinks ``(H,)`` in ``dtype``, an extra leaf."""
        if self.sink is None:
            return ()
        return ((self.sink + torch.linspace(-1.0, 1.0, self.nheads)).to(device=device, dtype=dtype),)

    def options(self, device) -> dict:
        """Keyword arguments of ``flash_attn_func`` / ``flash_attn_varlen_func`` for this row."""
        slopes = None
        if self.alibi:
            heads = torch.tensor([2.0 ** (-8.0 * (h + 1) / self.nheads) for h in range(self.nheads)])
            slopes = torch.stack([heads * (b + 1) for b in range(self.batch)]).to(device)  # (B, H)
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap, alibi_slopes=slopes)

    def kv_case(self):
        """The ``verify_kvcache.KVCase`` of a kvcache row."""
        return KVCase(
            **self.sizes(), new=self.new, seqlens=self.cache, causal=self.causal, page=self.page,
            window=self.window, softcap=self.softcap, alibi=self.alibi, sink=self.sink,
        )  # fmt: skip


# On a GPU: head dims 64, 128 and 256; MHA, GQA and MQA; causal and not; Sq != Sk both ways (a causal
# Sq > Sk has rows that see no key); varlen; a paged cache (pages of 256 rows, as upstream requires)
# with rows appended; window, softcap, ALiBi and dropout. Run in bf16 and fp16.
GPU_TABLE = (
    Case(2, 512, 512, 8, 8, 128),
    Case(2, 512, 512, 8, 8, 128, causal=True),
    Case(2, 113, 203, 8, 2, 64),
    Case(2, 203, 113, 8, 2, 64, causal=True),
    Case(2, 128, 384, 4, 1, 256, causal=True),
    Case(1, 256, 256, 4, 4, 256),
    Case(1, 1024, 1024, 8, 2, 128, causal=True, window=(128, 0)),
    Case(2, 300, 500, 4, 4, 64, window=(64, 32)),
    Case(2, 512, 512, 8, 8, 128, causal=True, softcap=30.0),
    Case(2, 333, 333, 8, 4, 128, causal=True, alibi=True),
    Case(2, 200, 333, 4, 4, 64, alibi=True),
    Case(4, 517, 517, 8, 2, 128, kind="varlen", causal=True, lens_q=(1, 100, 517, 256), lens_k=(1, 100, 517, 256)),
    Case(3, 400, 450, 4, 4, 64, kind="varlen", lens_q=(64, 400, 7), lens_k=(450, 3, 129)),
    Case(3, 4, 2048, 16, 2, 128, kind="kvcache", causal=True, cache=(300, 2000, 1093), new=4, page=256),
    Case(2, 1, 2048, 8, 8, 64, kind="kvcache", causal=True, cache=(511, 1500), new=1, page=256),
    Case(2, 256, 256, 8, 2, 128, kind="dropout", causal=True, dropout=0.17),
    Case(2, 200, 300, 4, 4, 64, kind="dropout", dropout=0.1),
    # gpt-oss: GQA 64/8 heads at head dim 64, a window of 128 with sinks; and its decoding step.
    Case(1, 1024, 1024, 64, 8, 64, causal=True, window=(127, 0), sink=0.0),
    Case(
        2, 1, 2048, 64, 8, 64, kind="kvcache", causal=True, cache=(1500, 90), new=1, page=256, window=(127, 0), sink=0.0
    ),
)

# For the interpreter on a CPU: the same kinds and features at sizes it runs in seconds.
TINY_TABLE = (
    Case(1, 32, 32, 2, 2, 32, causal=True),
    Case(2, 17, 29, 4, 2, 16),
    Case(1, 29, 17, 2, 1, 64, causal=True),
    Case(1, 40, 40, 2, 2, 32, causal=True, window=(8, 0)),
    Case(1, 21, 33, 2, 2, 16, window=(5, 3), softcap=5.0, alibi=True),
    Case(3, 19, 23, 2, 1, 32, kind="varlen", causal=True, lens_q=(1, 19, 6), lens_k=(1, 23, 6)),
    Case(2, 3, 64, 4, 2, 32, kind="kvcache", causal=True, cache=(10, 27), new=3, page=16),
    Case(1, 24, 24, 4, 2, 32, kind="dropout", causal=True, dropout=0.17),
    Case(1, 30, 30, 4, 2, 16, causal=True, window=(7, 0), sink=0.0),
    Case(2, 1, 64, 4, 2, 16, kind="kvcache", causal=True, cache=(40, 3), new=1, page=16, window=(7, 0), sink=0.0),
)


# ----------------------------------------------------------------------------- one check


def inputs(case: Case, dtype, device, seed: int) -> tuple:
    """``(q, k, v, dout, extra)``: drawn on the CPU in fp32 from ``seed``, then cast and moved.
    Dense: ``(B, S, H, D)``; varlen: ``(sum lens, H, D)`` with ``extra`` the ``cu_seqlens`` and
    maximum lengths of ``flash_attn_varlen_func``; else ``extra`` is empty."""
    gen = torch.Generator().manual_seed(seed)
    if case.kind == "varlen":
        rows_q, rows_k = [sum(case.lens_q)], [sum(case.lens_k)]  # (total, H, D)
    else:
        rows_q, rows_k = [case.batch, case.seqlen_q], [case.batch, case.seqlen_k]  # (B, S, H, D)
    shapes = [(*rows_q, case.nheads), (*rows_k, case.nheads_k), (*rows_k, case.nheads_k), (*rows_q, case.nheads)]
    q, k, v, dout = (torch.randn(*s, case.head_dim, generator=gen).to(device=device, dtype=dtype) for s in shapes)
    extra: dict = {}
    if case.kind == "varlen":
        for side, lens in (("q", case.lens_q), ("k", case.lens_k)):
            cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
            extra[f"cu_seqlens_{side}"], extra[f"max_seqlen_{side}"] = cu, max(lens)
    return q, k, v, dout, extra


def grads(fn: Callable, q, k, v, dout, *more) -> tuple:
    """``fn(q, k, v, *more)`` and its backward on fresh leaf copies: ``(out, dq, dk, dv, *dmore)``
    (``more``: the sinks, if the row has them)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, *more)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return (out.detach(), *(t.grad.detach() for t in leaves))


def subject(case: Case, options: dict, extra: dict) -> Callable:
    """``fn(q, k, v[, sinks]) -> out``: the call under test, on the ``triton`` backend."""

    def fn(q, k, v, *sinks):
        sink = sinks[0] if sinks else None
        with use_backend("triton"):
            if case.kind == "varlen":
                return flash_attn_varlen_func(q, k, v, **extra, **options, learnable_sink=sink)
            return flash_attn_func(q, k, v, dropout_p=case.dropout, **options, learnable_sink=sink)

    return fn


def _per_sequence(case: Case, attend: Callable, extra: dict) -> Callable:
    """``fn(q, k, v[, sinks])`` applying ``attend(q_b, k_b, v_b, b[, sinks])`` (each ``(1, S_b, H, D)``)
    to each sequence of a varlen row and packing the outputs back, or to the whole batch (``b`` None)."""
    if case.kind != "varlen":
        return lambda q, k, v, *sinks: attend(q, k, v, None, *sinks)
    cu_q, cu_k = (extra[f"cu_seqlens_{side}"].tolist() for side in "qk")

    def fn(q, k, v, *sinks):
        rows_q, rows_k = ([slice(c[b], c[b + 1]) for b in range(case.batch)] for c in (cu_q, cu_k))
        outs = [
            attend(q[None, rq], k[None, rk], v[None, rk], b, *sinks)[0]
            for b, (rq, rk) in enumerate(zip(rows_q, rows_k))
        ]
        return torch.cat(outs)

    return fn


def torch_math(case: Case, options: dict, extra: dict, upcast: bool, keep=None) -> Callable:
    """The reference (``flash_recipe.testing.attention``) in fp32/fp64 (``upcast``) or in the input
    dtype; ``keep``: dropout's kept entries ``(B, H, Sq, Sk)``."""
    slopes = options["alibi_slopes"]

    def attend(q, k, v, b, *sinks):
        row_slopes = None if slopes is None else slopes if b is None else slopes[b]
        dropout = dict(dropout_p=case.dropout, dropout_mask=keep) if case.dropout else {}
        window, softcap = options["window_size"], options["softcap"]
        return attention(
            q,
            k,
            v,
            None,
            case.causal,
            upcast=upcast,
            window=window,
            softcap=softcap,
            alibi_slopes=row_slopes,
            sinks=sinks[0] if sinks else None,
            **dropout,
        )[0]

    return _per_sequence(case, attend, extra)


def sdpa_flash_reason(case: Case, dtype, device) -> Optional[str]:
    """Why SDPA's flash kernel cannot be this row's peer, or None when it can."""
    if device.type != "cuda":
        return "not on CUDA: the peer is torch math in the input dtype"
    if str(dtype) not in ("torch.float16", "torch.bfloat16"):
        return f"SDPA flash runs fp16/bf16, not {str(dtype).replace('torch.', '')}"
    features = [n for n, on in (("window", case.window != (-1, -1)), ("softcap", case.softcap), ("ALiBi", case.alibi),
                                ("dropout", case.dropout), ("a KV cache", case.kind == "kvcache"),
                                ("attention sinks", case.sink is not None)) if on]  # fmt: skip
    if features:
        return f"SDPA flash has no {', '.join(features)}: the peer is torch math in the input dtype"
    lens = zip(case.lens_q, case.lens_k) if case.kind == "varlen" else [(case.seqlen_q, case.seqlen_k)]
    if case.causal and any(sq != sk for sq, sk in lens):
        return "causal with Sq != Sk: SDPA's is_causal aligns top-left; the peer is torch math in the input dtype"
    return None


def sdpa_flash(case: Case, extra: dict) -> Callable:
    """SDPA restricted to its flash backend, in flash-attn's layout, sequence by sequence for varlen."""

    def attend(q, k, v, b):
        gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=case.causal, **gqa
            )
        return out.transpose(1, 2)

    return _per_sequence(case, attend, extra)


def _judge(names: tuple, got: tuple, truth: tuple, peer: tuple) -> tuple:
    """Errors of ``got`` and the rule's bounds from ``peer``, both against ``truth``, per name."""
    errors = {n: max_error(g, t) for n, g, t in zip(names, got, truth)}
    bounds = {n: accuracy_bound(max_error(p, t), FACTORS[n]) for n, p, t in zip(names, peer, truth)}
    return errors, bounds


def _replayed_mask(case: Case, q, k, v, options: dict, seed: int):
    """Dropout's kept entries ``(B, H, Sq, Sk)`` of the call made with ``seed``: the same seed run
    again with ``return_attn_probs=True`` (negative probabilities were dropped)."""
    torch.manual_seed(seed)
    with torch.no_grad(), use_backend("triton"):
        _, _, probs = flash_attn_func(q, k, v, case.dropout, return_attn_probs=True, **options)
    return probs >= 0


def check(case: Case, dtype, device, seed: int = 0) -> dict:
    """One row in one dtype: ``{case, kind, features, dtype, peer, peer_note, errors, bounds,
    [torch_math_bounds], passed}`` (see the module docstring for what each kind compares)."""
    row: dict[str, Any] = {"case": case.id, "kind": case.kind, "features": case.features}
    row["dtype"] = str(dtype).replace("torch.", "")
    if case.kind == "kvcache":
        result = check_kvcache_case(case.kv_case(), dtype, device, "triton", seed)
        note = "a paged cache with rows appended: verify's KV oracle rebuilds it in torch, in the input dtype"
        row.update(peer="torch_math", peer_note=note, errors=result["errors"], bounds=result["bounds"])
        row["passed"] = bool(result["passed"])
        return row
    q, k, v, dout, extra = inputs(case, dtype, device, seed)
    options = case.options(device)
    high = compute_dtype(dtype, upcast=True)
    keep = None
    if case.dropout:
        torch.manual_seed(seed)
    more = case.sinks(dtype, device)  # the sinks: a leaf, dsink checked as dq is
    got = grads(subject(case, options, extra), q, k, v, dout, *more)
    if case.dropout:
        keep = _replayed_mask(case, q, k, v, options, seed)
    truth = grads(torch_math(case, options, extra, True, keep), *(t.to(high) for t in (q, k, v, dout, *more)))
    same = grads(torch_math(case, options, extra, False, keep), q, k, v, dout, *more)
    names = ("out", *GRADIENTS, *("dsink" for _ in more))
    errors, bounds = _judge(names, got, truth, same)
    reason = sdpa_flash_reason(case, dtype, device)
    row.update(peer="torch_math", peer_note=reason)
    if reason is None:
        try:
            peer = grads(sdpa_flash(case, extra), q, k, v, dout)
        except RuntimeError as exc:  # no flash kernel for this case here: the rule's torch-math peer
            row["peer_note"] = f"SDPA flash refused ({str(exc).splitlines()[0][:160]}): torch math in the input dtype"
        else:
            row["torch_math_bounds"] = bounds
            bounds = _judge(names, got, truth, peer)[1]
            row["peer"] = "sdpa_flash"
    if keep is not None:
        errors["kept"], bounds["kept"] = _kept_error(case, keep, truth_probs(case, q, k, options, high))
    finite = all(bool(t.isfinite().all()) for t in got)
    row.update(errors=errors, bounds=bounds, passed=finite and all(errors[n] <= bounds[n] for n in errors))
    if not finite:
        row["error"] = "non-finite values in the output or gradients"
    return row


def truth_probs(case: Case, q, k, options: dict, dtype):
    """The reference's probabilities ``(B, H, Sq, Sk)`` before dropout (zero where not visible)."""
    _, probs = attention(
        q.to(dtype), k.to(dtype), k.to(dtype), None, case.causal, window=options["window_size"],
        softcap=options["softcap"], alibi_slopes=options["alibi_slopes"], return_probs=True,
    )  # fmt: skip
    return probs


def _kept_error(case: Case, keep, probs) -> tuple:
    """``(|kept fraction - (1 - p)|, KEPT_SIGMAS standard deviations)`` over the visible entries."""
    visible = probs > 0
    count = int(visible.sum())
    kept = float(keep[visible].float().mean()) if count else 1.0 - case.dropout
    sigma = math.sqrt(case.dropout * (1.0 - case.dropout) / max(count, 1))
    return abs(kept - (1.0 - case.dropout)), KEPT_SIGMAS * sigma


def safe_check(case: Case, dtype, device, seed: int = 0) -> dict:
    """``check``, with an exception (a kernel that fails to compile or run) turned into a failed row."""
    begin = time.perf_counter()
    try:
        row = check(case, dtype, device, seed)
    except Exception as exc:
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        row = {"case": case.id, "kind": case.kind, "features": case.features, "dtype": str(dtype).replace("torch.", "")}
        row.update(passed=False, error=f"{type(exc).__name__}: {text}")
    row["seconds"] = round(time.perf_counter() - begin, 3)
    return row


def run_subject(case: Case, dtype, device, seed: int = 0) -> None:
    """The calls the check of ``case`` makes on the ``triton`` backend, and only those (what
    ``flash-recipe warmup --for check`` records)."""
    if case.kind == "kvcache":
        q, k_cache, v_cache, k_new, v_new, kwargs = kv_inputs(case.kv_case(), dtype, device, seed)
        with use_backend("triton"):
            flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
        return
    q, k, v, dout, extra = inputs(case, dtype, device, seed)
    options = case.options(device)
    grads(subject(case, options, extra), q, k, v, dout, *case.sinks(dtype, device))
    if case.dropout:
        _replayed_mask(case, q, k, v, options, seed)


def feature_order(name: str) -> tuple:
    """Heads, mask, head dims (by size), then the kinds and options, as the table's comment lists them."""
    order = ["MHA", "GQA", "MQA", "causal", "Sq!=Sk", "D", "varlen", "KV cache", "paged", "append", "window"]
    if name[:1] == "D" and name[1:].isdigit():
        return (order.index("D"), int(name[1:]), name)
    return (order.index(name), 0, name) if name in order else (len(order), 0, name)
