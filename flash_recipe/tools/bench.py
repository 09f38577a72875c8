"""``flash-recipe bench``: attention throughput side by side with its peers, in one run.

For each shape (sequence length x head dim x causal x MHA/GQA x dtype) and each peer that can run
it, the forward, backward and forward+backward are timed and converted to TFLOP/s:

    forward FLOPs  = 4 * batch * nheads * seqlen_q * seqlen_k * headdim   (halved when causal)
    backward FLOPs = 2.5 * forward FLOPs

Timing (``_Timer``), the way ``triton.testing.do_bench`` does it: warm-up calls first; then on a
GPU the repetitions are issued back to back, each between its own pair of CUDA events, with the L2
cache flushed (a buffer larger than L2 overwritten) before each, outside the pair, and one
synchronisation after the last; the median of the per-repetition times is reported. On the CPU
each call is timed with the wall clock. The host time spent issuing each timed call is reported
beside it (``{mode}_host_us``, median).

A figure is only reported where it is the peer's own speed (``judge``): a mode whose timed
repetitions made torch.compile compile anything, a peer that fell back to eager code under
torch.compile (a graph break, dynamo's recompile limit), and a mode whose peak memory says the
S x S scores were materialised (``memory_verdict``) are errors with the reason, without TFLOP/s.
Dynamo's caches are cleared before each peer's shape, so a compiled peer compiles once per shape.

Peers, each only where available: ``flash_recipe`` (the Triton kernels; on the CPU, the public
``flash_attn_func`` on its automatic backend), ``flash_recipe_pointers`` (the Triton kernels with
TMA tensor descriptors off, to measure what they bring), ``flash_recipe_ws`` (the forward's loops
warp-specialised, where the GPU's family takes it: ``ops.features.WARP_SPEC_FAMILIES``), torch
SDPA per backend (``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``; on the CPU
plain ``sdpa``), ``flex``
(FlexAttention compiled with static shapes), ``flash_attn`` (upstream), and flash_recipe's 8-bit
attention for inference, forward only (``FORWARD_ONLY_PEERS``; its FLOPs counted as 16-bit ones):
``sage_fp16`` (``sageattn``, P.V in fp16) and, on GPUs with FP8 tensor cores, ``sage_fp8``. The
batch is chosen so that each shape holds about ``--tokens`` tokens.

``--json FILE`` writes the context line and every row, rewritten after each row, so an
interrupted run keeps what it measured. ``peak_memory`` measures what one training step of a peer
allocates (used by ``python -m devtools.campaign``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import platform
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .. import __version__, atomic_json, dispatch
from ..api import flash_attn_func
from ..dispatch import use_backend
from ..ops import features
from ..sage import sageattn
from . import host_cost
from .bench_timing import UNFUSED_PEERS, Timer, Timing, dynamo_counters, fresh_dynamo, grown, judge
from .sizes import Sizes
from .verify import versions

MODES = ("fwd", "bwd", "fwd_bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


@dataclasses.dataclass(frozen=True)
class Shape(Sizes):
    """A self-attention problem (``seqlen_q == seqlen_k``: ``seqlen``) of ``dtype``, causal or not."""

    causal: bool
    dtype: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seqlen_q != self.seqlen_k:
            raise ValueError(
                f"bench shapes are self-attention: seqlen_q ({self.seqlen_q}) must equal seqlen_k ({self.seqlen_k})"
            )

    @property
    def seqlen(self) -> int:
        return self.seqlen_q

    @property
    def id(self) -> str:
        kind = "mha" if self.group == 1 else f"gqa{self.group}"
        mask = "causal" if self.causal else "full"
        return f"B{self.batch}-S{self.seqlen}-H{self.nheads}-{kind}-D{self.head_dim}-{mask}-{self.dtype}"

    def columns(self) -> dict:
        """The shape's columns of a row (``COLUMNS``)."""
        return dict(
            batch=self.batch, seqlen=self.seqlen, nheads=self.nheads, nheads_k=self.nheads_k,
            head_dim=self.head_dim, causal=self.causal, dtype=self.dtype,
        )  # fmt: skip

    def flops(self, mode: str) -> float:
        return self.forward_flops(self.causal) * FLOP_FACTOR[mode]


# ----------------------------------------------------------------------------- peers
# A peer maps (q, k, v, causal) in flash layout (B, S, H, D) to the output, or raises.


def _sdpa(backend_name: Optional[str]):
    def run(q, k, v, causal):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        gqa = qt.shape[1] != kt.shape[1]
        if backend_name is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa).transpose(1, 2)
        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa).transpose(1, 2)

    return run


def _flash_recipe(backend_name: Optional[str], descriptors: Optional[bool] = None, warp_spec: bool = False):
    """flash_recipe on ``backend_name`` (None: automatic); ``descriptors`` False forces the Triton
    kernels' pointer loads where they would use TMA tensor descriptors, ``warp_spec`` asks for the
    forward's warp-specialised loops (``ops.features``)."""

    def run(q, k, v, causal):
        forced = features.using_descriptors(descriptors) if descriptors is not None else contextlib.nullcontext()
        asked = features.using_warp_specialization(True) if warp_spec else contextlib.nullcontext()
        with use_backend(backend_name), forced, asked:
            return flash_attn_func(q, k, v, causal=causal)

    return run


def _flex():
    """FlexAttention compiled with static shapes. ``measure`` clears dynamo's caches before each
    shape, so each shape compiles once (a forward, and one more with autograd on): a compiled
    ``flex_attention`` that met more shapes would recompile per shape and, past dynamo's recompile
    limit, run its eager code, which materialises the S x S scores."""
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, causal):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        mask = None
        if causal:
            key = (qt.shape[2], kt.shape[2], q.device)
            if key not in masks:
                masks.clear()  # one shape at a time: keep only its mask
                masks[key] = create_block_mask(causal_mask, None, None, key[0], key[1], device=q.device)
            mask = masks[key]
        return compiled(qt, kt, vt, block_mask=mask, enable_gqa=qt.shape[1] != kt.shape[1]).transpose(1, 2)

    return run


def _sage(pv_dtype: str):
    """flash_recipe's 8-bit attention (``sageattn``, forward only) with P.V in ``pv_dtype``."""

    def run(q, k, v, causal):
        return sageattn(q, k, v, "NHD", is_causal=causal, pv_dtype=pv_dtype)

    return run


# Peers that run no backward (8-bit attention is for inference): their bwd modes are not timed.
FORWARD_ONLY_PEERS = frozenset({"sage_fp16", "sage_fp8"})


def _upstream_flash_attn():
    import flash_attn  # an optional peer, found by ``peers``

    return lambda q, k, v, causal: flash_attn.flash_attn_func(q, k, v, causal=causal)


def peers(device_type: str) -> dict[str, Callable]:
    """The peers that can run on this machine, by name (availability only; shapes may still fail)."""
    if device_type != "cuda":
        return {"flash_recipe": _flash_recipe(None), "sdpa": _sdpa(None)}
    found = {}
    if dispatch.TritonBackend().is_available() is None:
        from ..ops import int8_attention, targets  # import Triton, which a CPU-only install may lack

        found["flash_recipe"] = _flash_recipe("triton")
        found["flash_recipe_pointers"] = _flash_recipe("triton", descriptors=False)  # the same without TMA
        target = targets.target_of(torch.device("cuda"))
        if features.warp_specialization_available() and features.takes_warp_specialization(target):
            found["flash_recipe_ws"] = _flash_recipe("triton", warp_spec=True)  # warp-specialised forward
        found["sage_fp16"] = _sage("fp16")
        if int8_attention.fp8_problem(targets.target_of(torch.device("cuda"))) is None:
            found["sage_fp8"] = _sage("fp8")
    for name, backend in (
        ("sdpa_flash", "FLASH_ATTENTION"),
        ("sdpa_efficient", "EFFICIENT_ATTENTION"),
        ("sdpa_cudnn", "CUDNN_ATTENTION"),
        ("sdpa_math", "MATH"),
    ):
        found[name] = _sdpa(backend)
    found["flex"] = _flex()
    if dispatch.FlashAttnBackend().is_available() is None:
        found["flash_attn"] = _upstream_flash_attn()
    return found


def measure(
    peer: Callable, shape: Shape, device, modes, timer: Timer, unfused: bool = False, forward_only: bool = False
) -> dict:
    """Time one peer on one shape; returns ``judge``'s figures per mode and the first call's ms.
    ``forward_only``: the backward modes are not timed, and the row's error says so."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, shape.dtype)

    q, k, v = (torch.randn(s, generator=gen).to(device, dtype) for s in (shape.q_shape, shape.kv_shape, shape.kv_shape))
    cuda = device.type == "cuda"
    fresh_dynamo()
    start = dynamo_counters()
    if cuda:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    with torch.no_grad():
        peer(q, k, v, shape.causal)
    if cuda:
        torch.cuda.synchronize()
    first_call_ms = (time.perf_counter() - begin) * 1e3
    timings: dict[str, Timing] = {}
    if "fwd" in modes:
        with torch.no_grad():
            timings["fwd"] = timer(lambda: peer(q, k, v, shape.causal))
    skipped = [mode for mode in modes if mode != "fwd"] if forward_only else []
    if ("bwd" in modes or "fwd_bwd" in modes) and not forward_only:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        dout = torch.randn_like(q)
        if "fwd_bwd" in modes:
            timings["fwd_bwd"] = timer(lambda: peer(*leaves, shape.causal).backward(dout))
        if "bwd" in modes:
            holder = {}

            def setup():
                for t in leaves:
                    t.grad = None
                holder["out"] = peer(*leaves, shape.causal)

            timings["bwd"] = timer(lambda: holder["out"].backward(dout), setup)
    result = {"first_call_ms": first_call_ms, **judge(shape, timings, grown(start, dynamo_counters()), unfused)}
    if skipped:
        note = f"{', '.join(skipped)}: forward only (inference)"
        result["error"] = f"{result['error']}; {note}" if "error" in result else note
    return result


MEMORY_MODES = ("fwd", "fwd_bwd")


def peak_memory(peer: Callable, shape: Shape, device, mode: str) -> dict:
    """Peak CUDA memory of one training step of ``peer`` on ``shape``: its forward (``mode="fwd"``,
    inputs requiring grad, so it keeps what the backward needs) or forward and backward
    (``"fwd_bwd"``).

    q, k, v and dout are allocated first and one untimed step runs (compilation, caches); then the
    allocator's peak is reset and one step is measured. Returns MiB: ``before_mb``, allocated
    before the step (the inputs, plus anything the peer keeps between calls); ``peak_mb``, the
    peak above that (the output, what is saved for the backward, the gradients, workspace); and
    ``total_mb``, the peak including ``before_mb``.
    """
    if device.type != "cuda":
        raise ValueError(f"peak memory needs a CUDA device, got {device.type!r}")
    if mode not in MEMORY_MODES:
        raise ValueError(f"mode must be one of {MEMORY_MODES}, got {mode!r}")
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, shape.dtype)

    def make(size):
        return torch.randn(size, generator=gen, device=device, dtype=dtype)

    leaves = [make(s).requires_grad_() for s in (shape.q_shape, shape.kv_shape, shape.kv_shape)]
    dout = make(shape.q_shape)

    def step() -> None:
        out = peer(*leaves, shape.causal)
        if mode == "fwd_bwd":
            out.backward(dout)
        for t in leaves:
            t.grad = None

    step()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"mode": mode, "before_mb": before / 2**20, "peak_mb": (peak - before) / 2**20, "total_mb": peak / 2**20}


def shapes(seqlens, head_dims, causal_values, gqa_values, dtypes, tokens: int, nheads: int) -> list[Shape]:
    out = []
    for dtype in dtypes:
        for head_dim in head_dims:
            for causal in causal_values:
                for gqa in gqa_values:
                    for seqlen in seqlens:
                        out.append(
                            Shape(
                                max(1, tokens // seqlen),
                                seqlen,
                                seqlen,
                                nheads,
                                max(1, nheads // 4) if gqa else nheads,
                                head_dim,
                                causal,
                                dtype,
                            )
                        )
    return out


def run_bench(args, progress=print, on_row: Optional[Callable[[list], None]] = None) -> list[dict]:
    """Measure every chosen peer on every shape of ``args``; ``on_row(rows)`` after each row."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    available = peers(device.type)
    chosen = args.peer or list(available)
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise ValueError(f"peer must be one of {sorted(available)} on {device.type}, got {unknown}")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the timer's events and memory statistics are the current device's
    timer = Timer(device.type, args.warmup, args.reps)
    rows = []
    for shape in shapes(args.seqlen, args.head_dim, args.causal, args.gqa, args.dtype, args.tokens, args.nheads):
        for name in chosen:
            row = {"shape": shape.id, "peer": name, **shape.columns()}
            try:
                row.update(
                    measure(
                        available[name], shape, device, args.mode, timer, name in UNFUSED_PEERS,
                        name in FORWARD_ONLY_PEERS,
                    )
                )  # fmt: skip
            except Exception as exc:  # a peer that cannot run a shape is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            progress(_row_text(row, args.mode))
            if on_row is not None:
                on_row(rows)
    return rows


# ----------------------------------------------------------------------------- output


def _row_text(row: dict, modes) -> str:
    cells = [f"{row[f'{m}_tflops']:8.3f}" if f"{m}_tflops" in row else f"{'n/a':>8}" for m in modes]
    host = [f"{row[f'{m}_host_us']:8.1f}" if f"{m}_host_us" in row else f"{'n/a':>8}" for m in modes]
    peak = f"{row['peak_mb']:9.1f}" if "peak_mb" in row else f"{'n/a':>9}"
    first = f"{row['first_call_ms']:10.1f}" if "first_call_ms" in row else f"{'n/a':>10}"
    text = f"{row['shape']:<44} {row['peer']:<15} {' '.join(cells)} {' '.join(host)} {peak} {first}"
    return text + (f"  failed: {row['error']}" if "error" in row else "")


def header(modes) -> str:
    cells = " ".join(f"{m:>8}" for m in modes)
    return (
        f"{'shape':<44} {'peer':<15} {cells} {cells} {'peak MB':>9} {'first ms':>10}  "
        "(TFLOP/s per mode, then host us per call per mode)"
    )


COLUMNS = [
    "shape",
    "peer",
    "batch",
    "seqlen",
    "nheads",
    "nheads_k",
    "head_dim",
    "causal",
    "dtype",
    "fwd_ms",
    "bwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "bwd_tflops",
    "fwd_bwd_tflops",
    "fwd_host_us",
    "bwd_host_us",
    "fwd_bwd_host_us",
    "peak_mb",
    "fwd_peak_mb",
    "bwd_peak_mb",
    "fwd_bwd_peak_mb",
    "first_call_ms",
    "error",
]


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_markdown(rows: list[dict], modes, context: str) -> str:
    """A table: TFLOP/s and host us per call per mode, peak MB, and why a peer failed; a mode
    without a figure reads n/a."""
    lines = [
        context,
        "",
        "| shape | peer | "
        + " | ".join(f"{m} TFLOP/s" for m in modes)
        + " | "
        + " | ".join(f"{m} host us" for m in modes)
        + " | peak MB | failed |",
        "|---|---|" + "---:|" * (2 * len(modes) + 1) + "---|",
    ]
    for row in rows:
        cells = [f"{row[f'{m}_tflops']:.3f}" if f"{m}_tflops" in row else "n/a" for m in modes]
        cells += [f"{row[f'{m}_host_us']:.1f}" if f"{m}_host_us" in row else "n/a" for m in modes]
        cells.append(f"{row['peak_mb']:.1f}" if "peak_mb" in row else "n/a")
        cells.append(str(row.get("error", "")).replace("|", "\\|"))
        lines.append(f"| {row['shape']} | {row['peer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], mode: str, path: str) -> None:
    """TFLOP/s against sequence length, one line per peer, one panel per remaining shape key."""
    try:
        import matplotlib  # an optional dependency (the ``plot`` extra)

        matplotlib.use("Agg")  # no display is needed
        import matplotlib.pyplot as plt  # after the backend is chosen
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'flash-recipe[plot]'") from exc
    groups: dict = {}
    for row in rows:
        if f"{mode}_tflops" in row:
            key = (row["head_dim"], row["causal"], row["nheads_k"] != row["nheads"], row["dtype"])
            groups.setdefault(key, {}).setdefault(row["peer"], []).append((row["seqlen"], row[f"{mode}_tflops"]))
    if not groups:
        raise RuntimeError(f"no {mode} measurements to plot")
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (key, by_peer) in zip(axes[0], sorted(groups.items())):
        for peer, points in sorted(by_peer.items()):
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d{key[0]} {'causal' if key[1] else 'full'} {'gqa' if key[2] else 'mha'} {key[3]}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(f"{mode} TFLOP/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def context_line() -> str:
    v = versions()
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    return (
        f"device {device}, {time.strftime('%Y-%m-%d')}, flash_recipe {__version__}, "
        f"torch {v['torch']}, triton {v['triton']}, command: flash-recipe bench {' '.join(sys.argv[2:])}".rstrip()
    )


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seqlen",
        type=_ints,
        default=[512, 1024, 2048, 4096, 8192, 16384],
        help="comma-separated sequence lengths (default 512..16384)",
    )
    parser.add_argument("--head-dim", type=_ints, default=[64, 128, 256], help="comma-separated head dims")
    parser.add_argument(
        "--causal",
        type=lambda s: {"both": [False, True], "yes": [True], "no": [False]}[s],
        default=[False, True],
        metavar="{both,yes,no}",
    )
    parser.add_argument(
        "--gqa",
        type=lambda s: {"both": [False, True], "yes": [True], "no": [False]}[s],
        default=[False, True],
        metavar="{both,yes,no}",
        help="GQA uses nheads/4 kv heads (at least 1)",
    )
    parser.add_argument(
        "--dtype", type=lambda s: s.split(","), default=["float16", "bfloat16"], help="comma-separated dtypes"
    )
    parser.add_argument("--mode", type=lambda s: s.split(","), default=list(MODES), help="fwd,bwd,fwd_bwd")
    parser.add_argument("--peer", action="append", help="peer to run (repeatable); default: all available")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen per shape")
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", help="torch device, default cuda if available else cpu")
    parser.add_argument("--csv", help="write the rows as CSV to this file")
    parser.add_argument("--markdown", help="write a markdown table to this file")
    parser.add_argument("--plot", help="write a PNG of TFLOP/s against seqlen (needs matplotlib)")
    parser.add_argument("--json", help="write the context and rows as JSON to this file, rewritten after each row")
    parser.add_argument(
        "--host",
        nargs=argparse.REMAINDER,
        metavar="OPTIONS",
        help="measure the host cost per call instead (Python calls and microseconds, launches stubbed, beside torch "
        "SDPA's); the options after it are flash_recipe.tools.host_cost's (--host --help lists them)",
    )


def run(args) -> int:
    if args.host is not None:
        return host_cost.main(args.host, prog="flash-recipe bench --host")
    bad = [m for m in args.mode if m not in MODES] or [
        d for d in args.dtype if d not in ("float16", "bfloat16", "float32")
    ]
    if bad:
        print(
            f"flash-recipe bench: unknown mode or dtype {bad}; modes {MODES}, dtypes float16,bfloat16,float32",
            file=sys.stderr,
        )
        return 2
    context = context_line()
    print(context)
    print(header(args.mode))

    def write_json(rows: list, complete: bool = False) -> None:
        document = {"context": context, "modes": list(args.mode), "complete": complete, "rows": rows}
        atomic_json.write_json(args.json, document)  # a reader never sees a half-written file

    try:
        rows = run_bench(args, on_row=write_json if args.json else None)
    except ValueError as exc:
        print(f"flash-recipe bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        write_json(rows, complete=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            f.write(to_csv(rows))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(rows, args.mode, context))
    if args.plot:
        plot(rows, "fwd" if "fwd" in args.mode else args.mode[0], args.plot)
    return 0 if any("error" not in row for row in rows) else 1
