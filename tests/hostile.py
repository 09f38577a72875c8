"""Hostile input to the public API: a table of cases, each run in a process of its own.

Each row is ``Case(name, call, expect, arg)``: ``call()`` makes one public-API call; ``expect``
is the exception class it must raise, whose message must name ``arg`` (and contain ``fix``, the
one-line remedy, where the row gives one), or ``OK``: the call must return the right result
(``call`` then returns ``(got, want)``, checked by ``close``) without a warning.

``run(name, backend, timeout)`` runs one row in a child process forked from a server that has
imported torch and flash_recipe but run nothing, so a hang is killed after ``timeout`` seconds and
reported as ``"hang"`` instead of stalling the suite, and a crash shows as ``"crash"``.
``python tests/hostile.py`` prints every row's outcome under both backends and the counts.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import warnings
from typing import Callable, NamedTuple, Optional

import torch

OK = "ok"
BACKENDS = ("triton", "sdpa")


class Case(NamedTuple):
    name: str
    call: Callable
    expect: object  # an exception class, or OK
    arg: str = ""  # the argument the message must name
    fix: str = ""  # the one-line fix the message must give


def _t(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape) * 7 + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def close(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None if ``got`` (float32) matches the float64 reference ``want`` (NaN where it is NaN),
    else what differs. The bound is 1e-5 plus twice float32's own rounding at these sizes."""
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch.equal(got.isnan(), want.isnan()):
        return f"NaN at {int(got.isnan().sum())} entries, expected {int(want.isnan().sum())}"
    if got.numel() == 0:
        return None
    err = (got.double() - want.double()).nan_to_num(0.0).abs().max().item()
    return None if err <= 2e-6 * max(1.0, want.nan_to_num(0.0).abs().max().item()) + 1e-5 else f"max error {err:.3e}"


# -- the calls ----------------------------------------------------------------------------------


def _fa(q=None, k=None, v=None, **options):
    from flash_recipe import flash_attn_func

    q = _t(1, 8, 2, 16) if q is None else q
    k = _t(1, 8, 2, 16, seed=1) if k is None else k
    v = _t(1, 8, 2, 16, seed=2) if v is None else v
    return flash_attn_func(q, k, v, **options)


def _qkvpacked(qkv, **options):
    from flash_recipe import flash_attn_qkvpacked_func

    return flash_attn_qkvpacked_func(qkv, **options)


def _fa_ok(q, k, v, **options):
    """``flash_attn_func`` against the float64 reference (q, k, v in flash-attn's layout)."""
    from flash_recipe import flash_attn_func
    from flash_recipe.reference import attention_reference

    got = flash_attn_func(q, k, v, **options)
    want, _ = attention_reference(q, k, v, options.get("softmax_scale"), options.get("causal", False))
    return got, want


def _varlen(max_q=8, max_k=8, cu_q=None, cu_k=None, q=None, **options):
    from flash_recipe import flash_attn_varlen_func

    q = _t(8, 2, 16) if q is None else q
    k, v = _t(8, 2, 16, seed=1), _t(8, 2, 16, seed=2)
    cu_q = _i32(0, 3, 8) if cu_q is None else cu_q
    cu_k = _i32(0, 3, 8) if cu_k is None else cu_k
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **options)


def _varlen_ok(max_q, max_k):
    """Varlen with generous ``max_seqlen_*`` against the dense reference of each sequence."""
    from flash_recipe.reference import attention_reference

    q, k, v = _t(8, 2, 16), _t(8, 2, 16, seed=1), _t(8, 2, 16, seed=2)
    got = _varlen(max_q, max_k, causal=True)
    parts = [attention_reference(*(t[a:b][None] for t in (q, k, v)), causal=True)[0][0] for a, b in ((0, 3), (3, 8))]
    return got, torch.cat(parts)


def _cache(**changes):
    from flash_recipe import flash_attn_with_kvcache

    args = dict(q=_t(1, 1, 2, 16), k_cache=_t(2, 32, 1, 16, seed=1), v_cache=_t(2, 32, 1, 16, seed=2), cache_seqlens=5)
    args.update(changes)
    return flash_attn_with_kvcache(**args)


def _paged(table, **changes):
    from flash_recipe import flash_attn_varlen_func

    k, v = _t(3, 16, 2, 16, seed=1), _t(3, 16, 2, 16, seed=2)
    args = dict(max_seqlen_q=8, max_seqlen_k=20)
    args.update(changes)
    return flash_attn_varlen_func(_t(8, 2, 16), k, v, _i32(0, 3, 8), _i32(0, 20, 30), block_table=table, **args)


def _sdpa(query=None, key=None, value=None, **options):
    from flash_recipe import scaled_dot_product_attention

    query = _t(1, 2, 8, 16) if query is None else query
    key = _t(1, 2, 8, 16, seed=1) if key is None else key
    value = _t(1, 2, 8, 16, seed=2) if value is None else value
    return scaled_dot_product_attention(query, key, value, **options)


def _sdpa_ok(query, key, value, **options):
    from flash_recipe import scaled_dot_product_attention

    got = scaled_dot_product_attention(query, key, value, **options)
    want = torch.nn.functional.scaled_dot_product_attention(*(t.double() for t in (query, key, value)), **options)
    return got, want


def _nan_row(**options):
    """A NaN in one query row: that row's output is NaN on every backend, the others are exact."""
    q = _t(1, 8, 2, 16)
    q[0, 3, 1, 5] = math.nan
    return _fa_ok(q, _t(1, 8, 2, 16, seed=1), _t(1, 8, 2, 16, seed=2), **options)


def _expanded_rows():
    q = _t(1, 1, 2, 16).expand(1, 8, 2, 16)  # every query the same row: stride 0 along seqlen
    k = _t(1, 8, 1, 16, seed=1).expand(1, 8, 2, 16)  # one head for both: stride 0 along nheads
    return _fa_ok(q, k, _t(1, 8, 2, 16, seed=2), causal=True)


_PAGES = _i32(0, 1, 2, 0).view(2, 2)  # sequence 0: pages 0, 1 (20 keys); sequence 1: page 2 (10 keys)
BIG = 2**40
INT32_OVER = 2**31
META = torch.device("meta")
LAYOUT_FIX = "scaled_dot_product_attention"

CASES = [
    # -- tensors: type, rank, dtype, device, shape -----------------------------------------------
    Case("q-list", lambda: _fa(q=[[1.0]]), TypeError, "q"),
    Case("q-int", lambda: _fa(q=torch.zeros(1, 8, 2, 16, dtype=torch.int32)), TypeError, "q", "q.to(torch."),
    Case("q-float64", lambda: _fa(q=_t(1, 8, 2, 16, dtype=torch.float64)), TypeError, "q", "q.to(torch."),
    Case("q-rank3", lambda: _fa(q=_t(8, 2, 16)), ValueError, "q"),
    Case("k-dtype", lambda: _fa(k=_t(1, 8, 2, 16, dtype=torch.float16)), TypeError, "k", "k.to(q.dtype)"),
    Case("k-device", lambda: _fa(k=torch.empty(1, 8, 2, 16, device=META)), ValueError, "k", "k.to(q.device)"),
    Case("k-batch", lambda: _fa(k=_t(2, 8, 2, 16)), ValueError, "k"),
    Case("v-seqlen", lambda: _fa(v=_t(1, 7, 2, 16)), ValueError, "v"),
    Case("k-headdim", lambda: _fa(k=_t(1, 8, 2, 32)), ValueError, "k"),
    Case("heads-not-multiple", lambda: _fa(q=_t(1, 8, 3, 16)), ValueError, "k"),
    Case(
        "bhsd-to-flash",
        lambda: _fa(q=_t(1, 4, 16, 32), k=_t(1, 4, 32, 32), v=_t(1, 4, 32, 32)),
        ValueError,
        "k",
        LAYOUT_FIX,
    ),
    Case("headdim-512", lambda: _fa(*(_t(1, 8, 2, 512, seed=s) for s in range(3))), ValueError, "q"),
    Case("headdim-1024", lambda: _fa(*(_t(1, 8, 2, 1024, seed=s) for s in range(3))), ValueError, "q"),
    Case("headdim-0", lambda: _fa(*(_t(1, 8, 2, 0, seed=s) for s in range(3))), ValueError, "q"),
    Case("nheads-0", lambda: _fa(*(_t(1, 8, 0, 16, seed=s) for s in range(3))), ValueError, "q"),
    Case("batch-0", lambda: _fa_ok(*(_t(0, 8, 2, 16, seed=s) for s in range(3))), OK),
    Case("seqlen-q-0", lambda: _fa_ok(_t(1, 0, 2, 16), _t(1, 8, 2, 16, seed=1), _t(1, 8, 2, 16, seed=2)), OK),
    Case("last-dim-strided", lambda: _fa(q=_t(1, 8, 16, 2).transpose(2, 3)), ValueError, "q", "q.contiguous()"),
    Case("last-dim-stride-0", lambda: _fa(q=_t(1, 8, 2, 1).expand(1, 8, 2, 16)), ValueError, "q", "q.contiguous()"),
    Case("expanded-rows-and-heads", _expanded_rows, OK),
    Case(
        "scores-over-2^63-bytes",  # B 2^20, Sq = Sk 2^20, H 8: 2^63 scores, on meta tensors (nothing allocated)
        lambda: _fa(*(torch.empty(2**20, 2**20, 8, 64, device=META, dtype=torch.float16) for _ in range(3))),
        ValueError,
        "q",
        "split the call",
    ),
    Case(
        "scores-over-2^63-bytes-fp32",  # 2^60 scores: 2^63 bytes in the float64 the reference holds them in
        lambda: _fa(*(torch.empty(1, 2**28, 16, 64, device=META) for _ in range(3))),
        ValueError,
        "q",
        "split the call",
    ),
    Case(
        "scores-over-2^63-bytes-packed",
        lambda: _qkvpacked(torch.empty(1, 2**30, 3, 2, 16, device=META, dtype=torch.float16)),
        ValueError,
        "qkv",
        "split the call",
    ),
    Case("nan-query-row", _nan_row, OK),
    Case("nan-query-row-causal", lambda: _nan_row(causal=True), OK),
    # -- scalars ---------------------------------------------------------------------------------
    Case("dropout-negative", lambda: _fa(dropout_p=-0.1), ValueError, "dropout_p"),
    Case("dropout-one", lambda: _fa(dropout_p=1.0), ValueError, "dropout_p"),
    Case("dropout-1.5", lambda: _fa(dropout_p=1.5), ValueError, "dropout_p"),
    Case("dropout-nan", lambda: _fa(dropout_p=math.nan), ValueError, "dropout_p"),
    Case("dropout-str", lambda: _fa(dropout_p="0.1"), TypeError, "dropout_p"),
    Case("scale-nan", lambda: _fa(softmax_scale=math.nan), ValueError, "softmax_scale"),
    Case("scale-inf", lambda: _fa(softmax_scale=math.inf), ValueError, "softmax_scale"),
    Case("scale-neg-inf", lambda: _fa(softmax_scale=-math.inf), ValueError, "softmax_scale"),
    Case("scale-str", lambda: _fa(softmax_scale="0.1"), TypeError, "softmax_scale"),
    Case("softcap-inf", lambda: _fa(softcap=math.inf), ValueError, "softcap"),
    Case("softcap-nan", lambda: _fa(softcap=math.nan), ValueError, "softcap"),
    Case("softcap-negative", lambda: _fa(softcap=-1.0), ValueError, "softcap"),
    Case("window-below-minus-one", lambda: _fa(window_size=(-2, 0)), ValueError, "window_size"),
    Case("window-over-int32", lambda: _fa(window_size=(2**63, 0)), ValueError, "window_size"),
    Case(
        "window-huge-is-unbounded",
        lambda: _fa_ok(*(_t(1, 8, 2, 16, seed=s) for s in range(3)), window_size=(2**30, 2**30)),
        OK,
    ),
    Case("causal-str", lambda: _fa(causal="yes"), TypeError, "causal"),
    Case("deterministic-str", lambda: _fa(deterministic="no"), TypeError, "deterministic"),
    Case("alibi-device", lambda: _fa(alibi_slopes=torch.empty(2, device=META)), ValueError, "alibi_slopes"),
    Case("alibi-float64", lambda: _fa(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, "alibi_slopes"),
    # -- varlen ----------------------------------------------------------------------------------
    Case("max-seqlen-q-2^30", lambda: _varlen_ok(2**30, 8), OK),  # lowered to the 8 tokens q holds
    Case("max-seqlen-k-2^30", lambda: _varlen_ok(8, 2**30), OK),
    Case("max-seqlen-q-2^40", lambda: _varlen(max_q=BIG), ValueError, "max_seqlen_q"),
    Case("max-seqlen-q-over-int32", lambda: _varlen(max_q=INT32_OVER), ValueError, "max_seqlen_q"),
    Case("max-seqlen-k-2^63", lambda: _varlen(max_k=2**63), ValueError, "max_seqlen_k"),
    Case("max-seqlen-negative", lambda: _varlen(max_q=-1), ValueError, "max_seqlen_q"),
    Case(
        "cu-int64",
        lambda: _varlen(cu_q=torch.tensor([0, 3, 8])),
        TypeError,
        "cu_seqlens_q",
        "cu_seqlens_q.to(torch.int32)",
    ),
    Case("cu-device", lambda: _varlen(cu_k=torch.empty(3, dtype=torch.int32, device=META)), ValueError, "cu_seqlens_k"),
    Case("cu-decreasing", lambda: _varlen(cu_q=_i32(0, 5, 3, 8)), ValueError, "cu_seqlens_q"),
    Case("varlen-q-rank4", lambda: _varlen(q=_t(1, 8, 2, 16)), ValueError, "q"),
    Case(
        "paged-page-out-of-range",
        lambda: _paged(_i32(0, 7).view(1, 2).expand(2, 2).contiguous()),
        ValueError,
        "block_table",
    ),
    Case(
        "paged-table-int64",
        lambda: _paged(torch.zeros(2, 2, dtype=torch.int64)),
        TypeError,
        "block_table",
        "block_table.to(torch.int32)",
    ),
    Case("paged-max-seqlen-k-2^30", lambda: (_paged(_PAGES, max_seqlen_k=2**30), _paged(_PAGES)), OK),
    Case(
        "paged-max-seqlen-over-int32",
        lambda: _paged(_i32(0, 1, 2, 0).view(2, 2), max_seqlen_k=2**32),
        ValueError,
        "max_seqlen_k",
    ),
    # -- KV cache --------------------------------------------------------------------------------
    Case("num-splits-2^40", lambda: _cache(num_splits=BIG), ValueError, "num_splits"),
    Case("num-splits-129", lambda: _cache(num_splits=129), ValueError, "num_splits"),
    Case("num-splits-negative", lambda: _cache(num_splits=-1), ValueError, "num_splits"),
    Case(
        "cache-seqlens-int64",
        lambda: _cache(cache_seqlens=torch.tensor([5])),
        TypeError,
        "cache_seqlens",
        "cache_seqlens.to(torch.int32)",
    ),
    Case("cache-seqlens-over", lambda: _cache(cache_seqlens=33), ValueError, "cache_seqlens"),
    Case("cache-seqlens-2^40", lambda: _cache(cache_seqlens=BIG), ValueError, "cache_seqlens"),
    Case("cache-batch-idx-out", lambda: _cache(cache_batch_idx=_i32(2)), ValueError, "cache_batch_idx"),
    Case("cache-leftpad-over", lambda: _cache(cache_leftpad=_i32(6)), ValueError, "cache_leftpad"),
    Case(
        "cache-dtype",
        lambda: _cache(k_cache=_t(2, 32, 1, 16, dtype=torch.float16)),
        TypeError,
        "k_cache",
        "k_cache.to(q.dtype)",
    ),
    Case("cache-device", lambda: _cache(v_cache=torch.empty(2, 32, 1, 16, device=META)), ValueError, "v_cache"),
    Case("cache-k-without-v", lambda: _cache(k=_t(1, 1, 1, 16)), ValueError, "v"),
    Case("cache-softcap-nan", lambda: _cache(softcap=math.nan), ValueError, "softcap"),
    Case("cache-scale-inf", lambda: _cache(softmax_scale=math.inf), ValueError, "softmax_scale"),
    Case(
        "cache-strided-last-dim", lambda: _cache(q=_t(1, 1, 16, 2).transpose(2, 3)), ValueError, "q", "q.contiguous()"
    ),
    # -- SDPA: its own layout (batch, nheads, seqlen, headdim) ----------------------------------
    Case(
        "sdpa-gqa-off", lambda: _sdpa(key=_t(1, 1, 8, 16), value=_t(1, 1, 8, 16)), ValueError, "key", "enable_gqa=True"
    ),
    Case("sdpa-heads-not-divisor", lambda: _sdpa(query=_t(1, 3, 8, 16), enable_gqa=True), ValueError, "key"),
    Case("sdpa-value-seqlen", lambda: _sdpa(value=_t(1, 2, 7, 16)), ValueError, "value", "(1, 2, 7, 16)"),
    Case("sdpa-key-headdim", lambda: _sdpa(key=_t(1, 2, 8, 32)), ValueError, "key", "(1, 2, 8, 32)"),
    Case("sdpa-key-batch", lambda: _sdpa(key=_t(3, 2, 8, 16)), ValueError, "key", "(3, 2, 8, 16)"),
    Case("sdpa-rank5", lambda: _sdpa(query=_t(1, 1, 2, 8, 16)), ValueError, "query"),
    Case("sdpa-scale-nan", lambda: _sdpa(scale=math.nan), ValueError, "scale"),
    Case("sdpa-dropout-1.5", lambda: _sdpa(dropout_p=1.5), ValueError, "dropout_p"),
    Case(
        "sdpa-key-dtype",
        lambda: _sdpa(key=_t(1, 2, 8, 16, dtype=torch.float16)),
        TypeError,
        "key",
        "key.to(query.dtype)",
    ),
    Case("sdpa-mask-dtype", lambda: _sdpa(attn_mask=torch.zeros(8, 8, dtype=torch.int64)), TypeError, "attn_mask"),
    Case("sdpa-seqlen-0", lambda: _sdpa_ok(_t(1, 2, 0, 16), _t(1, 2, 8, 16, seed=1), _t(1, 2, 8, 16, seed=2)), OK),
    Case(
        "sdpa-scores-over-2^63-bytes",
        lambda: _sdpa(*(torch.empty(2**20, 8, 2**20, 64, device=META, dtype=torch.float16) for _ in range(3))),
        ValueError,
        "query",
        "split the call",
    ),
    Case("sdpa-headdim-512", lambda: _sdpa(*(_t(1, 2, 8, 512, seed=s) for s in range(3))), ValueError, "query"),
]
BY_NAME = {case.name: case for case in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


# -- running one case ---------------------------------------------------------------------------


def _child(name: str, backend: str, conn) -> None:
    """In the child: run the case under ``backend`` and send back what happened. The cases use CPU
    tensors, so the Triton kernels run through the interpreter, on a machine with a GPU too
    (Triton reads the variable when first imported, which happens here, not in the server)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import flash_recipe

    torch.set_num_threads(1)
    case = BY_NAME[name]
    result = {"error": None, "message": "", "warnings": [], "mismatch": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with flash_recipe.use_backend(backend):
                value = case.call()
            if case.expect == OK:
                result["mismatch"] = close(*value)
        except BaseException as exc:  # noqa: BLE001 (reported, whatever it is)
            result["error"], result["message"] = type(exc).__name__, str(exc)[:2000]
            result["mro"] = [c.__name__ for c in type(exc).__mro__]
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    conn.send(result)
    conn.close()


_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "flash_recipe", __name__])
    return _CONTEXT


def run(name: str, backend: str, timeout: float = 120.0) -> dict:
    """Run case ``name`` under ``backend`` in a child process; returns ``{"outcome", "detail"}``.

    Outcomes: ``"pass"`` (the expected error, naming the argument and giving the fix; or the right
    result without warnings), ``"wrong-error"``, ``"returned"`` (no error where one was due),
    ``"wrong-result"``, ``"warned"``, ``"hang"``, ``"crash"``.
    """
    case = BY_NAME[name]
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, backend, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            return {"outcome": "hang" if proc.is_alive() else "crash", "detail": f"no answer in {timeout:.0f} s"}
        try:
            result = parent.recv()
        except EOFError:
            return {"outcome": "crash", "detail": "the child died"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    return judge(case, result)


def judge(case: Case, result: dict) -> dict:
    """The outcome of ``case`` from what its child reported."""
    error, message = result["error"], result["message"]
    if case.expect == OK:
        if error is not None:
            return {"outcome": "wrong-error", "detail": f"{error}: {message}"}
        if result["mismatch"] is not None:
            return {"outcome": "wrong-result", "detail": result["mismatch"]}
        if result["warnings"]:
            return {"outcome": "warned", "detail": "; ".join(result["warnings"])}
        return {"outcome": "pass", "detail": ""}
    if error is None:
        return {"outcome": "returned", "detail": f"no error; expected {case.expect.__name__}"}
    if case.expect.__name__ not in result.get("mro", [error]):
        return {"outcome": "wrong-error", "detail": f"{error}: {message}"}
    missing = [word for word in (case.arg, case.fix) if word and word not in message]
    if missing:
        return {"outcome": "wrong-error", "detail": f"{missing} not in {error}: {message}"}
    return {"outcome": "pass", "detail": message}


def main() -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    counts: dict = {}
    for case in CASES:
        for backend in BACKENDS:
            found = run(case.name, backend)
            counts[found["outcome"]] = counts.get(found["outcome"], 0) + 1
            print(f"{case.name:32} {backend:7} {found['outcome']:12} {found['detail'][:150]}", flush=True)
    print(f"{len(CASES)} cases x {len(BACKENDS)} backends:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0 if set(counts) == {"pass"} else 1


if __name__ == "__main__":
    sys.exit(main())
