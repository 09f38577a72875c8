"""The steps the campaign runs in itself (``python -m devtools.campaign --step ...``):
the environment probe, the host cost per call and the peak-memory rows."""

from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Optional

import torch

from flash_recipe.api import explain
from flash_recipe.atomic_json import write_json
from flash_recipe.tools import bench, host_cost
from flash_recipe.tools.verify import versions

from .plan import HOST_CASES, MEMORY_PEERS, MEMORY_SEQLENS, TARGET, memory_shapes

# ----------------------------------------------------------------------------- the workers


def env_probe() -> dict:
    """The device and the software: what the report's header says."""
    info = {"cuda": torch.cuda.is_available(), "versions": versions(), "platform": platform.platform()}
    info["variables"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FLASH_RECIPE_", "TRITON_"))}
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            device_count=torch.cuda.device_count(),
        )
        q = torch.zeros(
            1, 128, TARGET["nheads"], TARGET["head_dim"], device="cuda", dtype=getattr(torch, TARGET["dtype"])
        )
        reasons = explain(q, q, q, causal=True)
        info["backends_for_target"] = reasons
        info["chosen_backend"] = next((name for name, why in reasons.items() if why is None), None)
        info["bench_peers"] = list(bench.peers("cuda"))
    return info


def memory_rows(seqlens, peers, result: Optional[str] = None, progress=print) -> list:
    """Peak memory (``bench.peak_memory``) of each peer, forward and forward + backward, at each
    sequence length, causal and not; rows written to ``result`` after each one."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    available = bench.peers(device.type)
    rows = []
    for shape in memory_shapes(seqlens):
        for mode in bench.MEMORY_MODES:
            for name in peers:
                row = {"shape": shape.id, "peer": name, **shape.columns()}
                try:
                    if name not in available:
                        raise ValueError(f"peer {name!r} is not available on {device.type}")
                    row.update(bench.peak_memory(available[name], shape, device, mode))
                except Exception as exc:  # reported, not fatal (out of memory included)
                    row.update(
                        mode=mode, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                    )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                text = row.get("error") or f"peak {row['peak_mb']:.1f} MiB above {row['before_mb']:.1f} MiB"
                progress(f"{shape.id:<44} {mode:<8} {name:<14} {text}")
                if result:
                    write_json(result, rows)
    return rows


def host_rows(cases=HOST_CASES, progress=print) -> dict:
    """The host cost per call (``host_cost.measure``) on the GPU at the decoding shape, twice: with
    Triton's launch stubbed (this package's own host work) and with real launches issued back to
    back (what a decoding loop's host spends per call); torch SDPA's beside each; then one
    ``torch.profiler`` trace per case (``host_cost.profile_case``: the top entries by self CPU time)."""
    device = torch.device("cuda")
    rows = []
    for stub in (True, False):
        for row in host_cost.measure(device, torch.bfloat16, host_cost.CACHE_GPU, stub, cases=cases):
            rows.append(row)
            progress(f"{row['case']:<14} launches {'stubbed' if stub else 'real':<8} {row['calls']:>4} calls "
                     f"{row['us']:8.1f} us, sdpa {row['sdpa_us']:8.1f} us")  # fmt: skip
    profiles = {}
    for name in cases:  # what the host time is below Python: one torch.profiler trace per case
        try:
            profiles[name] = host_cost.profile_case(name, device, torch.bfloat16, host_cost.CACHE_GPU)
        except Exception as exc:  # the trace is extra: its failure is reported, the rows kept
            profiles[name] = [
                {"name": f"profiler failed: {type(exc).__name__}: {exc}"[:300], "calls": 0, "self_cpu_us": 0}
            ]
        progress(f"{name:<14} profiled: {', '.join(e['name'] for e in profiles[name][:3])}")
    batch, nheads, nheads_k, head_dim = host_cost.SHAPE
    shape = f"B{batch}-H{nheads}-Hk{nheads_k}-D{head_dim}-S{host_cost.CACHE_GPU}-bfloat16"
    return {"shape": shape, "rows": rows, "profiles": profiles}


def worker_parser() -> argparse.ArgumentParser:
    """Options of ``--step env|host|memory``: the in-process part of a step, run in its subprocess."""
    parser = argparse.ArgumentParser(prog="python -m devtools.campaign --step")
    parser.add_argument("--step", choices=("env", "host", "memory"), required=True)
    parser.add_argument("--result", required=True, help="write the step's JSON result here")
    parser.add_argument(
        "--seqlen", type=lambda text: [int(x) for x in text.split(",") if x], default=list(MEMORY_SEQLENS)
    )
    parser.add_argument("--peer", action="append", help="peer to measure (repeatable)")
    return parser


def run_worker(argv: list) -> int:
    args = worker_parser().parse_args(argv)
    if args.step == "env":
        info = env_probe()
        write_json(args.result, info)
        print(json.dumps(info, indent=1))
        return 0
    if args.step == "host":
        document = host_rows()
        write_json(args.result, document)
        return 0
    rows = memory_rows(args.seqlen, args.peer or list(MEMORY_PEERS), args.result)
    write_json(args.result, rows)
    return 0 if rows and all("error" not in row for row in rows) else 1
