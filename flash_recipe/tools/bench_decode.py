"""Decoding speed: KV-cache bandwidth of one decoding step, with its peers side by side.

One query row per sequence over a full dense cache, Llama-3-8B's attention shape by default
(H = 32 query heads, Hk = 8 kv heads, D = 128, bf16)::

    q (B, 1, H, D)    k_cache, v_cache (B, S_cache, Hk, D)    cache_seqlens = S_cache

A step must read the whole cache once, ``2 * B * S_cache * Hk * D * element_size`` bytes, so its
speed is that many bytes over its time, reported in GB/s and as a share of the GPU's peak memory
bandwidth (``PEAK_BANDWIDTH``, the vendor's figure for the model; a device-to-device copy measured
in the same run is reported beside it). Peers, each timed in the same process:

- ``flash_recipe``: ``flash_attn_with_kvcache`` as users call it (GQA packing, split-KV by the rule);
- ``flash_recipe_unpacked``: the same kernels with GQA packing off (one program per query head);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa`` on the cache
  (torch picks its backend).

Run it as ``python -m flash_recipe.tools.bench_decode [--batch 1,8,32,64] [--cache 1024,8192,32768]
[--json FILE]``; it needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any, Callable, Optional

import torch
import triton.testing

from ..decoding import flash_attn_with_kvcache
from ..ops.kvcache import Cache, attention_kvcache
from ..ops.options import ScoreOptions

# Peak HBM bandwidth in bytes/s by GPU model name (vendor figures).
PEAK_BANDWIDTH = {
    "H100 80GB HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H200": 4.8e12,
    "A100-SXM4-80GB": 2.04e12,
    "A100-SXM4-40GB": 1.555e12,
}
PEERS = ("flash_recipe", "flash_recipe_unpacked", "sdpa")


def peak_bandwidth(name: str) -> Optional[float]:
    """The vendor's peak memory bandwidth of the GPU called ``name``, where known."""
    return next((peak for model, peak in PEAK_BANDWIDTH.items() if model in name), None)


def copy_bandwidth(device) -> float:
    """Bytes read and written per second by a 2 GiB device-to-device copy (median of timed runs)."""
    src = torch.empty(2**30, dtype=torch.uint16, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _step(peer: str, q, k_cache, v_cache, seqlens) -> Callable[[], Any]:
    """One decoding step of ``peer`` over the cache, as a function of no arguments."""
    if peer not in PEERS:
        raise ValueError(f"peer must be one of {', '.join(PEERS)}, got {peer!r}")
    return _STEPS[peer](q, k_cache, v_cache, seqlens)


def _flash_recipe(q, k_cache, v_cache, seqlens):
    return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)


def _flash_recipe_unpacked(q, k_cache, v_cache, seqlens):
    table = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)[:, None]
    cache = Cache(k_cache, v_cache, table, seqlens, None)
    options = ScoreOptions(
        softmax_scale=q.shape[-1] ** -0.5, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
    )
    return lambda: attention_kvcache(q, None, None, cache, None, options, pack_gqa=False)


def _sdpa(q, k_cache, v_cache, seqlens):
    qt, kt, vt = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    gqa = q.shape[2] != k_cache.shape[2]
    return lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)


_STEPS = {"flash_recipe": _flash_recipe, "flash_recipe_unpacked": _flash_recipe_unpacked, "sdpa": _sdpa}


def run(
    batches,
    caches,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    peers=PEERS,
    warmup: int = 25,
    rep: int = 100,
    report=print,
    graph: bool = False,
) -> dict:
    """Time every peer at every (batch, cache length); returns the context and the rows.

    Each step is timed as Python calls it (``us``: the launch overhead of each call included), and
    with ``graph`` also replayed from a CUDA graph (``graph_us``: the GPU's time alone)."""
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = peak_bandwidth(name)
    context = {
        "device": name,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "peak_bytes_per_s": peak,
        "copy_bytes_per_s": copy_bandwidth(device),
        "nheads": nheads,
        "nheads_k": nheads_k,
        "head_dim": head_dim,
        "dtype": "bfloat16",
        "command": "python -m flash_recipe.tools.bench_decode " + " ".join(sys.argv[1:]),
    }
    rows = []
    for batch in batches:
        for cache in caches:
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(batch, 1, nheads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            k_cache = torch.randn(batch, cache, nheads_k, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            v_cache = torch.randn_like(k_cache)
            seqlens = torch.full((batch,), cache, dtype=torch.int32, device=device)
            kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
            want = _step("sdpa", q, k_cache, v_cache, seqlens)().transpose(1, 2).float()
            for peer in peers:
                row = {"batch": batch, "cache": cache, "peer": peer, "kv_bytes": kv_bytes}
                try:
                    fn = _step(peer, q, k_cache, v_cache, seqlens)
                    got = fn()
                    got = got[0] if isinstance(got, tuple) else got
                    row["max_diff_vs_sdpa"] = (got.float() - want).abs().max().item()
                    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep)
                    row.update(us=ms * 1e3, bytes_per_s=kv_bytes / (ms * 1e-3))
                    if peak:
                        row["of_peak"] = row["bytes_per_s"] / peak
                    if graph:
                        ms = triton.testing.do_bench(_captured(fn), warmup=warmup, rep=rep)
                        row.update(graph_us=ms * 1e3, graph_bytes_per_s=kv_bytes / (ms * 1e-3))
                except Exception as exc:  # a peer that fails is reported, and the others go on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                report(_line(row))
            del q, k_cache, v_cache
    return {"context": context, "rows": rows}


def _captured(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream, as torch asks); returns
    the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _line(row: dict) -> str:
    head = f"B{row['batch']:<3} S{row['cache']:<6} {row['peer']:<22}"
    if "error" in row:
        return f"{head} n/a ({row['error']})"
    share = f"{100 * row['of_peak']:5.1f}% of peak" if "of_peak" in row else ""
    graphed = f"  graph {row['graph_us']:9.1f} us" if "graph_us" in row else ""
    return f"{head} {row['us']:9.1f} us  {row['bytes_per_s'] / 1e9:7.0f} GB/s  {share}{graphed}"


def markdown(result: dict, key: str = "bytes_per_s") -> str:
    """The rows as a table: one line per (batch, cache), each peer's GB/s and share of peak;
    ``key="graph_bytes_per_s"`` tabulates the CUDA-graph timings instead."""
    ctx = result["context"]
    peers = list(dict.fromkeys(row["peer"] for row in result["rows"]))
    peak = ctx["peak_bytes_per_s"]
    timing = "replayed from a CUDA graph (GPU time alone)" if key.startswith("graph") else "called from Python"
    lines = [
        f"Decoding steps {timing}.",
        f"device {ctx['device']}, {ctx['date']}, torch {ctx['torch']}, triton {ctx['triton']}, "
        f"H={ctx['nheads']} Hk={ctx['nheads_k']} D={ctx['head_dim']} {ctx['dtype']}, peak "
        f"{(ctx['peak_bytes_per_s'] or 0) / 1e9:.0f} GB/s, copy {ctx['copy_bytes_per_s'] / 1e9:.0f} GB/s; "
        f"command: {ctx['command']}",
        "",
        "| batch | cache | " + " | ".join(f"{p} GB/s (% peak)" for p in peers) + " | flash_recipe / sdpa |",
        "|---:|---:|" + "---:|" * (len(peers) + 1),
    ]
    by_key: dict = {}
    for row in result["rows"]:
        by_key.setdefault((row["batch"], row["cache"]), {})[row["peer"]] = row
    for (batch, cache), found in by_key.items():
        cells = []
        for peer in peers:
            row = found.get(peer, {})
            if key not in row:
                cells.append("n/a")
                continue
            share = f" ({100 * row[key] / peak:.0f}%)" if peak else ""
            cells.append(f"{row[key] / 1e9:.0f}{share}")
        ours, sdpa = found.get("flash_recipe", {}), found.get("sdpa", {})
        ratio = f"{ours[key] / sdpa[key]:.2f}x" if key in ours and key in sdpa else "n/a"
        lines.append(f"| {batch} | {cache} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flash_recipe.tools.bench_decode", description=__doc__.split("\n\n")[0]
    )
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--batch", type=ints, default=[1, 8, 32, 64])
    parser.add_argument("--cache", type=ints, default=[1024, 8192, 32768])
    parser.add_argument("--nheads", type=int, default=32)
    parser.add_argument("--nheads-k", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json", help="write the context and rows as JSON to this file")
    parser.add_argument("--markdown", help="write the table(s) to this file")
    parser.add_argument(
        "--cuda-graph", action="store_true", help="also time each step replayed from a CUDA graph (GPU time alone)"
    )
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    result = run(args.batch, args.cache, args.nheads, args.nheads_k, args.head_dim, graph=args.cuda_graph)
    table = markdown(result)
    if args.cuda_graph:
        table += "\n\n" + markdown(result, "graph_bytes_per_s")
    print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
