"""``flash-recipe verify``: every backend against the fp32 reference, with a reproducible fingerprint.

For a fixed-seed grid of shapes, in every dtype the device supports, each backend that can run
computes the forward and backward of ``flash_attn_func``; both are compared with
``flash_recipe.reference`` by the accuracy rule (``flash_recipe.testing.accuracy``): the error
may be at most 2x (output) or 3x (dq, dk, dv) that of plain torch computing the same attention in
the input dtype, plus a floor, measured against the reference in fp32 (fp64 for fp32 inputs).
The fingerprint is the sha256 of the output and gradient bytes of the deterministic backends
(``Backend.deterministic``: ``triton`` and ``reference``), called with ``deterministic=True`` (the
triton backend's default backward, checked by the rule too, adds dQ with atomics): the same
package with the same torch and Triton on the same device gives the same fingerprint, whatever
installed it.

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

import torch

from .. import __version__, dispatch
from ..api import explain, flash_attn_func
from ..dispatch import backend_names
from ..env.distinfo import distribution_info
from ..reference import attention_reference, compute_dtype
from ..testing import FACTORS, accuracy_bound, max_error
from .sizes import Sizes
from .verify_kvcache import KV_FULL_GRID, KV_SMALL_GRID, check_kvcache_case, report_row


@dataclasses.dataclass(frozen=True)
class Case(Sizes):
    """One ``flash_attn_func`` call: its sizes (``Sizes``), its mask and its score options."""

    causal: bool
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""  # "", "heads" for (H,) slopes, "batch" for (B, H) slopes
    softmax_scale: Optional[float] = None  # None: 1 / sqrt(head_dim)
    # Attention sinks: None, or per head ``sink + linspace(-1, 1, H)`` in the input dtype (``options``);
    # very negative: no effect; very positive: rows' weights near 0.
    sink: Optional[float] = None

    @property
    def id(self) -> str:
        extras = "".join(
            [
                f"-win{self.window[0]}_{self.window[1]}" if self.window != (-1, -1) else "",
                f"-cap{self.softcap:g}" if self.softcap else "",
                f"-alibi_{self.alibi}" if self.alibi else "",
                f"-scale{self.softmax_scale:g}" if self.softmax_scale is not None else "",
                f"-sink{self.sink:g}" if self.sink is not None else "",
            ]
        )
        return f"{self.sizes_id}-{'causal' if self.causal else 'full'}{extras}"

    def options(self, device, dtype=None) -> dict:
        """The keyword arguments of ``flash_attn_func`` for this case (ALiBi slopes as ALiBi defines them;
        sinks in ``dtype``, float32 by default, as a model holds them in its own dtype)."""
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
            learnable_sink=None
            if self.sink is None
            else (self.sink + torch.linspace(-1.0, 1.0, self.nheads)).to(device=device, dtype=dtype or torch.float32),
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
    Case(1, 45, 30, 4, 2, 32, True, sink=0.0),  # attention sinks; causal Sq > Sk: rows that see only the sink
    Case(1, 30, 41, 2, 1, 24, False, window=(6, 2), sink=4.0),
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
    Case(2, 1024, 1024, 8, 2, 64, True, window=(128, 0), sink=0.0),  # gpt-oss: GQA, a window of 128, sinks
    Case(2, 333, 517, 8, 8, 128, False, sink=3.0),
)


def versions() -> dict:
    """flash_recipe, torch (and its CUDA/HIP), Triton, flash-attn and Python versions, from metadata."""

    def dist_version(name: str) -> Optional[str]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "flash_recipe": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "triton": dist_version("triton") or dist_version("pytorch-triton") or dist_version("pytorch-triton-rocm"),
        "flash_attn": dist_version("flash-attn"),
        "python": platform.python_version(),
    }


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()})"


def _dtypes(device, names: Optional[list]) -> list:
    if names:
        return [getattr(torch, name) for name in names]
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        dtypes.remove(torch.bfloat16)
    return dtypes


def _inputs(case: Case, dtype, device, seed: int):
    """Deterministic inputs: drawn on the CPU in fp32 from ``seed``, then cast and moved."""
    gen = torch.Generator().manual_seed(seed)
    shapes = (case.q_shape, case.kv_shape, case.kv_shape, case.q_shape)
    q, k, v, dout = (torch.randn(s, generator=gen) for s in shapes)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _forward_backward(fn, q, k, v, dout, *more):
    """Run ``fn(q, k, v, *more)`` and its backward on fresh leaf copies; returns (out, dq, dk, dv, *dmore)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, *more)]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return (out.detach(), *(t.grad.detach() for t in leaves))


def check_case(case: Case, dtype, device, backend: str, seed: int) -> dict:
    """Verify one backend on one case; returns the errors, bounds, verdict and fingerprint."""
    q, k, v, dout = _inputs(case, dtype, device, seed)
    options = case.options(device, dtype)
    scale = case.head_dim**-0.5 if case.softmax_scale is None else case.softmax_scale
    sinks = options.pop("learnable_sink")
    more = () if sinks is None else (sinks,)  # the sinks are a leaf too: dsink is checked as dq is

    def reference(upcast):
        return lambda q_, k_, v_, *s_: attention_reference(
            q_,
            k_,
            v_,
            scale,
            case.causal,
            upcast=upcast,
            window=options["window_size"],
            softcap=options["softcap"],
            alibi_slopes=options["alibi_slopes"],
            sinks=s_[0] if s_ else None,
        )[0]

    def run(deterministic):
        return lambda q_, k_, v_, *s_: flash_attn_func(
            q_, k_, v_, **options, learnable_sink=s_[0] if s_ else None, deterministic=deterministic
        )

    # The truth gets high-precision leaves too, so its gradients are not rounded to the input dtype.
    high = compute_dtype(dtype, upcast=True)
    truth = _forward_backward(reference(True), *(t.to(high) for t in (q, k, v, dout, *more)))
    torch_same = _forward_backward(reference(False), q, k, v, dout, *more)
    # The fingerprint is the deterministic backward's; the triton backend's default backward (dQ added
    # with atomics, its last bits in the order the adds land) is checked by the rule beside it.
    atomic = any(b.name == backend and b.atomic_backward for b in dispatch.BACKENDS)
    with dispatch.use_backend(backend):
        got = _forward_backward(run(True), q, k, v, dout, *more)
        fast = _forward_backward(run(False), q, k, v, dout, *more) if atomic else got
    names = ("out", "dq", "dk", "dv", "dsink")[: len(got)]
    errors, bounds = {}, {}
    for name, g, f, t, s in zip(names, got, fast, truth, torch_same):
        errors[name] = max(max_error(g, t), max_error(f, t))
        bounds[name] = accuracy_bound(max_error(s, t), FACTORS[name])
    return report_row(case.id, dtype, backend, errors, bounds, (*got, *fast), got)


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
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases = {"small": SMALL_GRID, "full": FULL_GRID}.get(grid) or (FULL_GRID if dev.type == "cuda" else SMALL_GRID)
    names = backends or dispatch.backend_names()
    rows, skipped = [], {}
    for index, case in enumerate(cases):
        for dtype in _dtypes(dev, dtypes):
            q, k, v, _ = _inputs(case, dtype, dev, seed + index)
            reasons = explain(q, k, v, **case.options(dev))
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
                    except dispatch.BackendUnavailableError as exc:
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
