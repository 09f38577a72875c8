"""``flash-recipe verify``: every backend against the fp32 reference, with a reproducible fingerprint.

For a fixed-seed grid of shapes, in every dtype the device supports, each backend that can run
computes the forward and backward of ``flash_attn_func``; both are compared with
``flash_recipe.reference`` by the accuracy rule (``flash_recipe.testing.accuracy``): the error
may be at most 2x (output) or 3x (dq, dk, dv) that of plain torch computing the same attention in
the input dtype, plus a floor, measured against the reference in fp32 (fp64 for fp32 inputs).
The fingerprint is the sha256 of the output and gradient bytes of the deterministic backends
(``Backend.deterministic``: ``triton`` and ``reference``): the same package with the same torch
and Triton on the same device gives the same fingerprint, whatever installed it.

With ``--kvcache`` the report also covers ``flash_attn_with_kvcache`` (forward only): dense and
paged caches, new rows appended, rotary embeddings (interleaved and GPT-NeoX), left padding, batch
indices, windows, softcap, ALiBi and split-KV, against an oracle that rebuilds each batch entry's
cache in torch. The output follows the same rule (2x); the cache after the call must hold the new
values exactly where the oracle wrote them (the rotated keys by the same rule, 2x PyTorch
rotating in the input dtype) and be bitwise unchanged everywhere else. These cases are added to the
default grid, so they change the fingerprint; without ``--kvcache`` the report is exactly the
default one.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import platform
import sys
from importlib import metadata
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    causal: bool
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""  # "", "heads" for (H,) slopes, "batch" for (B, H) slopes
    softmax_scale: Optional[float] = None  # None: 1 / sqrt(head_dim)

    @property
    def id(self) -> str:
        extras = "".join(
            [
                f"-win{self.window[0]}_{self.window[1]}" if self.window != (-1, -1) else "",
                f"-cap{self.softcap:g}" if self.softcap else "",
                f"-alibi_{self.alibi}" if self.alibi else "",
                f"-scale{self.softmax_scale:g}" if self.softmax_scale is not None else "",
            ]
        )
        return (
            f"B{self.batch}-Sq{self.seqlen_q}-Sk{self.seqlen_k}-H{self.nheads}-Hk{self.nheads_k}"
            f"-D{self.head_dim}-{'causal' if self.causal else 'full'}{extras}"
        )

    def options(self, device) -> dict:
        """The keyword arguments of ``flash_attn_func`` for this case (ALiBi slopes as ALiBi defines them)."""
        import torch

        slopes = None
        if self.alibi:
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / self.nheads) for h in range(self.nheads)], device=device)
            if self.alibi == "batch":
                slopes = torch.stack([slopes * (b + 1) for b in range(self.batch)])
        return dict(
            causal=self.causal,
            window_size=self.window,
            softcap=self.softcap,
            alibi_slopes=slopes,
            softmax_scale=self.softmax_scale,
        )


# Small enough for the Triton interpreter on a CPU: odd lengths and head dims, a single query,
# Sq > Sk with causal (rows that see no key), MQA and GQA.
SMALL_GRID = (
    Case(1, 1, 33, 2, 1, 32, False),
    Case(2, 47, 47, 4, 2, 59, True),
    Case(1, 65, 33, 2, 2, 64, True),
    Case(1, 33, 65, 3, 1, 16, True),
    Case(1, 40, 24, 2, 2, 128, False),
    Case(1, 70, 70, 2, 1, 32, True, window=(20, 0)),  # sliding window: blocks outside it are skipped
    Case(1, 37, 50, 2, 2, 40, False, window=(8, 5), softcap=5.0, alibi="heads"),
)

# On a GPU: flash-attn's own test lengths, every head-dim bucket, both causal settings.
FULL_GRID = tuple(
    Case(b, sq, sk, h, hk, d, causal)
    for (b, sq, sk, h, hk, d) in (
        (2, 113, 203, 8, 2, 64),
        (2, 128, 217, 8, 8, 128),
        (2, 108, 256, 4, 1, 96),
        (1, 1023, 1024, 8, 2, 128),
        (4, 1, 147, 8, 8, 256),
        (2, 256, 512, 6, 2, 40),
        (1, 2048, 2048, 16, 4, 59),
        (2, 333, 111, 4, 4, 160),
        (1, 4096, 4096, 8, 8, 256),
    )
    for causal in (False, True)
) + (
    Case(2, 2048, 2048, 8, 2, 128, True, window=(256, 0)),
    Case(2, 1000, 1500, 8, 8, 64, False, window=(100, 37)),
    Case(2, 512, 512, 8, 4, 128, True, softcap=30.0),
    Case(2, 777, 555, 8, 8, 96, True, alibi="batch"),
)


def versions() -> dict:
    """flash_recipe, torch (and its CUDA/HIP), Triton, flash-attn and Python versions, from metadata."""
    import torch

    import flash_recipe

    def dist_version(name: str) -> Optional[str]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "flash_recipe": flash_recipe.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "triton": dist_version("triton") or dist_version("pytorch-triton") or dist_version("pytorch-triton-rocm"),
        "flash_attn": dist_version("flash-attn"),
        "python": platform.python_version(),
    }


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()})"


def _dtypes(device, names: Optional[list]) -> list:
    import torch

    if names:
        return [getattr(torch, name) for name in names]
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        dtypes.remove(torch.bfloat16)
    return dtypes


def _inputs(case: Case, dtype, device, seed: int):
    """Deterministic inputs: drawn on the CPU in fp32 from ``seed``, then cast and moved."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape_q = (case.batch, case.seqlen_q, case.nheads, case.head_dim)
    shape_k = (case.batch, case.seqlen_k, case.nheads_k, case.head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen) for s in (shape_q, shape_k, shape_k, shape_q))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _forward_backward(fn, q, k, v, dout):
    """Run ``fn(q, k, v)`` and its backward on fresh leaf copies; returns (out, dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return (out.detach(), *(t.grad.detach() for t in leaves))


def check_case(case: Case, dtype, device, backend: str, seed: int) -> dict:
    """Verify one backend on one case; returns the errors, bounds, verdict and fingerprint."""
    import torch

    import flash_recipe
    from flash_recipe.reference import attention_reference, compute_dtype
    from flash_recipe.testing import FACTORS, accuracy_bound, max_error

    q, k, v, dout = _inputs(case, dtype, device, seed)
    options = case.options(device)
    scale = case.head_dim**-0.5 if case.softmax_scale is None else case.softmax_scale

    def reference(upcast):
        return lambda q_, k_, v_: attention_reference(
            q_,
            k_,
            v_,
            scale,
            case.causal,
            upcast=upcast,
            window=options["window_size"],
            softcap=options["softcap"],
            alibi_slopes=options["alibi_slopes"],
        )[0]

    # The truth gets high-precision leaves too, so its gradients are not rounded to the input dtype.
    high = compute_dtype(dtype, upcast=True)
    truth = _forward_backward(reference(True), *(t.to(high) for t in (q, k, v, dout)))
    torch_same = _forward_backward(reference(False), q, k, v, dout)
    with flash_recipe.use_backend(backend):
        got = _forward_backward(lambda q_, k_, v_: flash_recipe.flash_attn_func(q_, k_, v_, **options), q, k, v, dout)
    names = ("out", "dq", "dk", "dv")
    errors, bounds = {}, {}
    for name, g, t, s in zip(names, got, truth, torch_same):
        errors[name] = max_error(g, t)
        bounds[name] = accuracy_bound(max_error(s, t), FACTORS[name])
    finite = all(bool(g.isfinite().all()) for g in got)
    digest = hashlib.sha256()
    for g in got:
        digest.update(g.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return {
        "case": case.id,
        "dtype": str(dtype).replace("torch.", ""),
        "backend": backend,
        "errors": errors,
        "bounds": bounds,
        "passed": finite and all(errors[n] <= bounds[n] for n in names),
        "fingerprint": digest.hexdigest(),
    }


# ----------------------------------------------------------------------------- KV cache


@dataclasses.dataclass(frozen=True)
class KVCase:
    """One ``flash_attn_with_kvcache`` call: ``new`` rows appended to a cache that holds ``seqlens``
    rows per batch entry (``capacity`` rows each), then ``seqlen_q`` queries attend over it.

    ``page`` > 0 stores the cache in shuffled pages of that many rows (``block_table``); ``rotary``
    is the rotary dim (0: none); ``leftpad`` the first valid row per entry (empty: 0);
    ``batch_idx`` maps batch element ``b`` to cache row ``batch + 1 - b`` of a cache with two
    spare rows; ``splits`` is ``num_splits`` (0: chosen from the GPU's size).
    """

    batch: int
    seqlen_q: int
    new: int
    nheads: int
    nheads_k: int
    head_dim: int
    seqlens: tuple
    capacity: int
    causal: bool = True
    page: int = 0
    rotary: int = 0
    interleaved: bool = True
    leftpad: tuple = ()
    batch_idx: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    splits: int = 0

    @property
    def id(self) -> str:
        parts = [
            f"kv-B{self.batch}-Sq{self.seqlen_q}-new{self.new}-H{self.nheads}-Hk{self.nheads_k}-D{self.head_dim}",
            f"cap{self.capacity}",
            f"page{self.page}" if self.page else "dense",
            "causal" if self.causal else "full",
        ]
        if self.rotary:
            parts.append(f"rot{self.rotary}{'i' if self.interleaved else 'n'}")
        for flag, name in ((self.leftpad, "leftpad"), (self.batch_idx, "batchidx"), (self.alibi, "alibi")):
            if flag:
                parts.append(name)
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        parts.append(f"split{self.splits}")
        return "-".join(parts)


# Small enough for the Triton interpreter: a decoding step with GQA; several new tokens into a
# paged cache with GPT-NeoX rotary, left padding, a window and split-KV; a full cache with nothing
# appended, batch indices, softcap and ALiBi (no causal mask).
KV_SMALL_GRID = (
    KVCase(2, 1, 1, 4, 2, 32, seqlens=(5, 40), capacity=64),
    KVCase(
        batch=2,
        seqlen_q=3,
        new=3,
        nheads=4,
        nheads_k=2,
        head_dim=32,
        seqlens=(10, 27),
        capacity=64,
        page=16,
        rotary=16,
        interleaved=False,
        leftpad=(2, 0),
        window=(8, 0),
        splits=2,
    ),
    KVCase(
        batch=3,
        seqlen_q=2,
        new=0,
        nheads=2,
        nheads_k=1,
        head_dim=24,
        seqlens=(7, 33, 48),
        capacity=48,
        causal=False,
        batch_idx=True,
        softcap=3.0,
        alibi=True,
        splits=3,
    ),
)

# On a GPU: realistic decoding and chunked prefill over caches of thousands of rows, every
# head-dim bucket, pages of 16 and 256 rows, split-KV chosen automatically.
KV_FULL_GRID = KV_SMALL_GRID + (
    KVCase(4, 1, 1, 32, 8, 128, seqlens=(1000, 4095, 17, 2047), capacity=4096),
    KVCase(3, 4, 4, 16, 2, 128, seqlens=(300, 2000, 4092), capacity=4096, page=256, rotary=64, interleaved=False),
    KVCase(
        batch=2,
        seqlen_q=128,
        new=128,
        nheads=8,
        nheads_k=8,
        head_dim=64,
        seqlens=(0, 900),
        capacity=2048,
        page=16,
        rotary=32,
        leftpad=(0, 37),
        window=(256, 0),
    ),
    KVCase(2, 5, 0, 8, 4, 256, seqlens=(777, 1500), capacity=2048, causal=False, batch_idx=True, alibi=True, splits=4),
    KVCase(2, 1, 1, 12, 1, 96, seqlens=(3000, 1), capacity=3072, window=(100, 0), softcap=30.0),
)


def _kv_inputs(case: KVCase, dtype, device, seed: int):
    """Deterministic inputs of one KV case: ``(q, k_cache, v_cache, k_new, v_new, kwargs)``, where
    ``kwargs`` are the remaining arguments of ``flash_attn_with_kvcache``. Drawn on the CPU."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, hk, d = case.batch, case.nheads_k, case.head_dim
    q = rand(b, case.seqlen_q, case.nheads, d)
    k_new = rand(b, case.new, hk, d) if case.new else None
    v_new = rand(b, case.new, hk, d) if case.new else None
    kwargs = dict(
        cache_seqlens=torch.tensor(case.seqlens, dtype=torch.int32, device=device),
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        num_splits=case.splits,
    )
    if case.page:
        width = case.capacity // case.page
        num_pages = b * width + 3  # pages no sequence uses must stay untouched
        order = torch.randperm(num_pages, generator=gen)[: b * width]
        kwargs["block_table"] = order.view(b, width).to(device=device, dtype=torch.int32)
        cache_shape = (num_pages, case.page, hk, d)
    else:
        rows = b + 2 if case.batch_idx else b
        cache_shape = (rows, case.capacity, hk, d)
        if case.batch_idx:
            kwargs["cache_batch_idx"] = torch.tensor([b + 1 - i for i in range(b)], dtype=torch.int32, device=device)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    if case.leftpad:
        kwargs["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
    if case.rotary:
        # RoPE tables: position p, pair j turns by p * 10000^(-2j / rotary_dim); rounded to q's dtype.
        positions = torch.arange(case.capacity, dtype=torch.float64)[:, None]
        inv_freq = 10000.0 ** (-torch.arange(0, case.rotary, 2, dtype=torch.float64) / case.rotary)
        angle = positions * inv_freq
        kwargs.update(
            rotary_cos=angle.cos().to(device=device, dtype=dtype),
            rotary_sin=angle.sin().to(device=device, dtype=dtype),
            rotary_interleaved=case.interleaved,
        )
    if case.alibi:
        kwargs["alibi_slopes"] = torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / case.nheads) for h in range(case.nheads)], device=device
        )
    return q, k_cache, v_cache, k_new, v_new, kwargs


def _kv_slots(case: KVCase, kwargs: dict, b: int, start: int, end: int) -> tuple:
    """``(index0, index1)`` of rows ``[start, end)`` of batch element ``b``'s cache entry, for a
    cache tensor indexed ``cache[index0, index1]``: (page, row in page) or (cache row, position)."""
    import torch

    device = kwargs["cache_seqlens"].device
    positions = torch.arange(start, end, device=device)
    if case.page:
        table = kwargs["block_table"][b].long()
        return table[positions // case.page], positions % case.page
    row = kwargs["cache_batch_idx"][b] if case.batch_idx else b
    return torch.full_like(positions, int(row)), positions


def _kv_oracle(case: KVCase, q, k_cache, v_cache, k_new, v_new, kwargs: dict, upcast: bool):
    """What the call must return and write: ``(out, k_cache_after, v_cache_after)``.

    ``upcast``: the truth (rotation in fp64, attention in ``compute_dtype(dtype, True)``), else
    plain PyTorch in the input dtype throughout. The caches come back in the compute precision.
    """
    import torch

    from flash_recipe.testing import attention, compute_dtype, rotary

    dtype, device = q.dtype, q.device
    high = compute_dtype(dtype, upcast)
    rot_dtype = torch.float64 if upcast else dtype
    k_after, v_after = k_cache.to(high, copy=True), v_cache.to(high, copy=True)
    moves = case.causal or case.window != (-1, -1)  # q rotates at each row's own position
    cos, sin = kwargs.get("rotary_cos"), kwargs.get("rotary_sin")
    outs = []
    for b in range(case.batch):
        n = case.seqlens[b]
        pad = case.leftpad[b] if case.leftpad else 0
        if case.new:
            k_b, v_b = k_new[b], v_new[b]
            if case.rotary:
                positions = torch.arange(n, n + case.new, device=device)
                k_b = rotary(k_b[None], cos, sin, positions[None], case.interleaved, rot_dtype)[0]
            slots = _kv_slots(case, kwargs, b, n, n + case.new)
            k_after[slots] = k_b.to(high)
            v_after[slots] = v_b.to(high)
        q_b = q[b]
        if case.rotary:
            positions = torch.arange(n, n + case.seqlen_q, device=device)
            if not moves:
                positions = torch.full_like(positions, n)
            q_b = rotary(q_b[None], cos, sin, positions[None], case.interleaved, rot_dtype)[0]
        visible = _kv_slots(case, kwargs, b, pad, n + case.new)
        keys, values = k_after[visible][None], v_after[visible][None]
        slopes = kwargs.get("alibi_slopes")
        out, _ = attention(
            q_b.to(high)[None],
            keys,
            values,
            case.head_dim**-0.5,
            case.causal,
            keys.shape[1] - case.seqlen_q,
            upcast=upcast,
            window=case.window,
            softcap=case.softcap,
            alibi_slopes=slopes,
        )
        outs.append(out)
    return torch.cat(outs), k_after, v_after


def check_kvcache_case(case: KVCase, dtype, device, backend: str, seed: int) -> dict:
    """Verify ``flash_attn_with_kvcache`` on one backend and one KV case (see the module docstring).

    Raises ``flash_recipe.BackendUnavailableError`` when the backend cannot run the case.
    Errors: ``out`` (bound: the accuracy rule, 2x), ``k_cache`` and ``v_cache``
    over the written rows (exact, except rotated keys: the rule, 2x), ``cache_rest`` over every other
    row of both caches (exact).
    """
    import torch

    import flash_recipe
    from flash_recipe.testing import FORWARD_FACTOR, accuracy_bound, max_error

    q, k_cache, v_cache, k_new, v_new, kwargs = _kv_inputs(case, dtype, device, seed)
    k_got, v_got = k_cache.clone(), v_cache.clone()
    with flash_recipe.use_backend(backend):
        out = flash_recipe.flash_attn_with_kvcache(q, k_got, v_got, k_new, v_new, **kwargs)
    truth = _kv_oracle(case, q, k_cache, v_cache, k_new, v_new, kwargs, upcast=True)
    same = _kv_oracle(case, q, k_cache, v_cache, k_new, v_new, kwargs, upcast=False)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for b in range(case.batch):
        written[_kv_slots(case, kwargs, b, case.seqlens[b], case.seqlens[b] + case.new)] = True
    errors = {
        "out": max_error(out, truth[0]),
        "k_cache": max_error(k_got[written], truth[1][written]),
        "v_cache": max_error(v_got[written], truth[2][written]),
        "cache_rest": max(max_error(k_got[~written], k_cache[~written]), max_error(v_got[~written], v_cache[~written])),
    }
    bounds = {
        "out": accuracy_bound(max_error(same[0], truth[0]), FORWARD_FACTOR),
        "k_cache": accuracy_bound(max_error(same[1][written], truth[1][written]), FORWARD_FACTOR)
        if case.rotary
        else 0.0,
        "v_cache": 0.0,
        "cache_rest": 0.0,
    }
    digest = hashlib.sha256()
    for t in (out, k_got, v_got):
        digest.update(t.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return {
        "case": case.id,
        "dtype": str(dtype).replace("torch.", ""),
        "backend": backend,
        "errors": errors,
        "bounds": bounds,
        "passed": bool(out.isfinite().all()) and all(errors[n] <= bounds[n] for n in errors),
        "fingerprint": digest.hexdigest(),
    }


def verify(
    backends: Optional[list] = None,
    grid: str = "auto",
    dtypes: Optional[list] = None,
    device: Optional[str] = None,
    seed: int = 0,
    progress=None,
    kvcache: bool = False,
) -> dict:
    """Run the verification and return the report (see ``flash-recipe verify --json``).

    ``kvcache``: also verify ``flash_attn_with_kvcache`` on the KV grid of the same size
    (``KV_SMALL_GRID`` or ``KV_FULL_GRID``); its rows follow the dense ones.
    """
    import torch

    import flash_recipe
    from flash_recipe import dispatch
    from flash_recipe.env.distinfo import distribution_info

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases = {"small": SMALL_GRID, "full": FULL_GRID}.get(grid) or (FULL_GRID if dev.type == "cuda" else SMALL_GRID)
    names = backends or dispatch.backend_names()
    rows, skipped = [], {}
    for index, case in enumerate(cases):
        for dtype in _dtypes(dev, dtypes):
            q, k, v, _ = _inputs(case, dtype, dev, seed + index)
            reasons = flash_recipe.explain(q, k, v, **case.options(dev))
            for name in names:
                if reasons[name] is not None:
                    skipped.setdefault(name, set()).add(reasons[name])
                    continue
                row = check_case(case, dtype, dev, name, seed + index)
                rows.append(row)
                if progress:
                    progress(row)
    if kvcache:
        kv_cases = {"small": KV_SMALL_GRID, "full": KV_FULL_GRID}.get(grid) or (
            KV_FULL_GRID if dev.type == "cuda" else KV_SMALL_GRID
        )
        for index, case in enumerate(kv_cases):
            for dtype in _dtypes(dev, dtypes):
                for name in names:
                    try:
                        row = check_kvcache_case(case, dtype, dev, name, seed + index)
                    except flash_recipe.BackendUnavailableError as exc:
                        prefix = f"backend {name!r} cannot run this call: "
                        why = str(exc)
                        skipped.setdefault(name, set()).add(why[len(prefix) :] if why.startswith(prefix) else why)
                        continue
                    rows.append(row)
                    if progress:
                        progress(row)
    fingerprint = hashlib.sha256()
    deterministic = dispatch.deterministic_backends()
    for row in rows:
        if row["backend"] in deterministic:
            fingerprint.update(f"{row['case']}|{row['dtype']}|{row['backend']}|{row['fingerprint']}\n".encode())
    verified = sorted({row["backend"] for row in rows}, key=dispatch.backend_names().index)
    missing = [name for name in (backends or []) if name not in verified]
    return {
        "passed": bool(rows) and all(row["passed"] for row in rows) and not missing,
        "fingerprint": fingerprint.hexdigest(),
        "backends": verified,
        "skipped": {name: sorted(why) for name, why in skipped.items() if name not in verified or name in missing},
        "device": _device_name(dev),
        "versions": versions(),
        "install": distribution_info("flash-recipe"),
        "seed": seed,
        "cases": rows,
    }


def format_table(report: dict) -> str:
    lines = [
        f"{'case':<38} {'dtype':<9} {'backend':<10} {'out err / bound':>22} {'worst grad err / bound':>24}  result"
    ]

    def excess(e: float, b: float) -> float:
        return e / b if b > 0 else (float("inf") if e > 0 else 0.0)

    for row in report["cases"]:
        e, b = row["errors"], row["bounds"]
        grad = max((n for n in e if n != "out"), key=lambda n: excess(e[n], b[n]))
        lines.append(
            f"{row['case']:<38} {row['dtype']:<9} {row['backend']:<10} "
            f"{e['out']:>10.2e} / {b['out']:<9.2e} {e[grad]:>10.2e} / {b[grad]:<9.2e}  "
            f"{'ok' if row['passed'] else 'MISMATCH'}"
        )
    if any(row["case"].startswith("kv-") for row in report["cases"]):
        lines.append("kv-* rows: flash_attn_with_kvcache; the last column is the worst cache update error / bound")
    for name, why in report["skipped"].items():
        lines.append(f"skipped {name}: {'; '.join(why)}")
    v = report["versions"]
    lines.append(
        f"device {report['device']} | flash_recipe {v['flash_recipe']} torch {v['torch']} triton {v['triton']} | "
        f"backends {', '.join(report['backends']) or 'none'}"
    )
    lines.append(f"fingerprint {report['fingerprint']}")
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from flash_recipe.dispatch import backend_names

    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument(
        "--backend",
        action="append",
        choices=backend_names(),
        help="verify only this backend (repeatable); it must be able to run",
    )
    parser.add_argument(
        "--grid",
        choices=("auto", "small", "full"),
        default="auto",
        help="shape grid: small (CPU-sized), full (GPU-sized); auto picks by device",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=("float16", "bfloat16", "float32"),
        help="dtype (repeatable); default: every dtype the device supports",
    )
    parser.add_argument("--device", help="torch device, default cuda if available else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kvcache",
        action="store_true",
        help="also verify flash_attn_with_kvcache (dense and paged caches, rotary, split-KV); adds cases, "
        "so the fingerprint differs from the default run's",
    )


def run(args) -> int:
    def progress(row: dict) -> None:
        verdict = "ok" if row["passed"] else "MISMATCH"
        print(f"  {row['case']} {row['dtype']} {row['backend']}: {verdict}", file=sys.stderr, flush=True)

    report = verify(
        args.backend, args.grid, args.dtype, args.device, args.seed, None if args.json else progress, args.kvcache
    )
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0 if report["passed"] else 1
