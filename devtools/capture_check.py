"""CUDA-graph capture of flash_recipe's calls: ``python -m devtools.capture_check [--json FILE]``.

Serving engines and ``generate`` with a static cache hide the host cost of a decoding step by
capturing it in a CUDA graph and replaying it. A call can be captured only if it never reads a
device tensor on the host (that synchronises, which capture forbids) and allocates only inside the
capture's memory pool. Each check below runs on the GPU, with every metadata tensor on the GPU:

- ``kvcache``: ``flash_attn_with_kvcache`` appending new keys and values (rotated), with
  ``cache_seqlens``, ``cache_batch_idx`` and ``cache_leftpad``;
- ``kvcache_paged``: the same over a paged cache (``block_table``);
- ``varlen``: ``flash_attn_varlen_func`` with ``cu_seqlens_q/k``;
- ``fwd``: ``flash_attn_func``; ``fwd_bwd``: its forward and backward (the gradients);
- ``compile``: a decoding step under ``torch.compile(mode="reduce-overhead")`` (which captures
  CUDA graphs itself), three steps with ``cache_seqlens`` changing in place.

What passes: the capture succeeds; a replay equals the eager call bit for bit (outputs, the cache
rows it wrote, gradients); and, for the cache checks, a replay after changing ``cache_seqlens`` in
place equals a fresh eager call with the new lengths. A check that fails says which of these and
why (the exception of a capture that read a tensor on the host, for example).

It needs a CUDA GPU (exit status 2 without one); the campaign runs it as its ``capture`` step.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

import torch

from flash_recipe import atomic_json
from flash_recipe.api import flash_attn_func, flash_attn_varlen_func
from flash_recipe.decoding import flash_attn_with_kvcache
from flash_recipe.dispatch import use_backend

CHECKS = ("kvcache", "kvcache_paged", "varlen", "fwd", "fwd_bwd", "compile")
# Llama-3-8B's attention shape at a small batch and cache: what a captured decoding step looks like.
BATCH, NHEADS, NHEADS_K, HEAD_DIM, CACHE, PAGE = 4, 32, 8, 128, 1024, 256


def _captured(fn: Callable[[], object]):
    """Capture ``fn`` in a CUDA graph (after warm-up runs on a side stream, as torch asks); returns
    ``(graph, outputs of the captured call)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def _same(got, want) -> Optional[str]:
    """None if the tensors (or tuples of them) are equal bit for bit, else what differs."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
            diff = (a.float() - b.float()).abs().max().item() if a is not None and b is not None else None
            return f"output {i} differs (max abs difference {diff})"
    return None


def _decode_case(paged: bool):
    """A decoding step's state and ``step(state) -> outputs``: new keys appended (rotated), then
    attention over the cache; the outputs include the cache rows it writes."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)

    rotary = CACHE + 16
    angles = torch.rand(rotary, HEAD_DIM // 4, device=device, generator=gen) * 6.28
    state = dict(
        q=rand(BATCH, 1, NHEADS, HEAD_DIM),
        k=rand(BATCH, 1, NHEADS_K, HEAD_DIM),
        v=rand(BATCH, 1, NHEADS_K, HEAD_DIM),
        cos=angles.cos().to(torch.bfloat16),
        sin=angles.sin().to(torch.bfloat16),
        seqlens=torch.tensor(
            [CACHE // 2, 7, CACHE - 8, 300][:BATCH], dtype=torch.int32, device=device
        ),  # room for 3 more steps
        leftpad=torch.tensor([0, 3, 1, 0][:BATCH], dtype=torch.int32, device=device),
    )
    if paged:
        pages = BATCH * CACHE // PAGE
        state.update(k_cache=rand(pages, PAGE, NHEADS_K, HEAD_DIM), v_cache=rand(pages, PAGE, NHEADS_K, HEAD_DIM))
        order = torch.randperm(pages, device=device, generator=gen).to(torch.int32)
        state["table"] = order.view(BATCH, CACHE // PAGE)
    else:
        state.update(
            k_cache=rand(BATCH + 2, CACHE, NHEADS_K, HEAD_DIM), v_cache=rand(BATCH + 2, CACHE, NHEADS_K, HEAD_DIM)
        )
        state["batch_idx"] = torch.tensor([5, 0, 2, 3][:BATCH], dtype=torch.int32, device=device)

    def step(s):
        extra = dict(block_table=s["table"]) if paged else dict(cache_batch_idx=s["batch_idx"])
        out, lse = flash_attn_with_kvcache(
            s["q"], s["k_cache"], s["v_cache"], s["k"], s["v"], rotary_cos=s["cos"], rotary_sin=s["sin"],
            cache_seqlens=s["seqlens"], cache_leftpad=s["leftpad"], causal=True, return_softmax_lse=True, **extra,
        )  # fmt: skip
        return out, lse, s["k_cache"], s["v_cache"]

    return state, step


def _clone(state: dict) -> dict:
    return {name: t.clone() for name, t in state.items()}


def check_decode(paged: bool) -> dict:
    """Capture, replay, and replay with new lengths, against eager calls on copies of the state."""
    original, step = _decode_case(paged)
    want = step(_clone(original))
    static = _clone(original)
    graph, outputs = _captured(lambda: step(static))
    for name, t in original.items():  # the warm-up and capture wrote into the caches: start again
        static[name].copy_(t)
    graph.replay()
    problem = _same(outputs, want)
    if problem:
        return {"status": "failed", "detail": f"replay vs eager: {problem}"}
    moved = _clone(original)
    moved["seqlens"].add_(1)  # one more row in every sequence: the next step
    want = step(_clone(moved))
    for name, t in moved.items():
        static[name].copy_(t)
    graph.replay()
    problem = _same(outputs, want)
    if problem:
        return {"status": "failed", "detail": f"replay after changing cache_seqlens in place vs eager: {problem}"}
    return {"status": "passed", "detail": "replay equals eager bit for bit, also after cache_seqlens changed in place"}


def check_varlen() -> dict:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    lengths = [37, 1, 130, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = int(sum(lengths))
    q, k, v = (torch.randn(total, h, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
               for h in (NHEADS, NHEADS_K, NHEADS_K))  # fmt: skip

    def step():
        return flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    want = step()
    graph, out = _captured(step)
    graph.replay()
    problem = _same(out, want)
    return {"status": "failed", "detail": problem} if problem else {"status": "passed", "detail": "replay equals eager"}


def check_dense(backward: bool) -> dict:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(2, 512, h, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
               for h in (NHEADS, NHEADS_K, NHEADS_K))  # fmt: skip
    dout = torch.randn(2, 512, NHEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    if backward:
        for t in (q, k, v):
            t.requires_grad_(True)

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        if not backward:
            return (out,)
        # ``out`` detached: an output that kept its graph alive would keep q, k and v's gradient
        # accumulators from an eager step on the default stream, which the captured backward would
        # then wait for across streams and so invalidate the capture.
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    want = step()
    graph, outputs = _captured(step)
    graph.replay()
    problem = _same(outputs, want)
    return {"status": "failed", "detail": problem} if problem else {"status": "passed", "detail": "replay equals eager"}


def check_compile() -> dict:
    """A decoding step under ``torch.compile(mode="reduce-overhead")``: three steps, lengths growing
    in place, each against the eager step."""
    original, step = _decode_case(paged=False)
    compiled = torch.compile(step, mode="reduce-overhead")
    static = _clone(original)
    for i in range(3):
        want = step(_clone(static))
        got = compiled(static)
        problem = _same(got, want)
        if problem:
            return {"status": "failed", "detail": f"step {i}: {problem}"}
        static["seqlens"].add_(1)  # the next step, in place
    return {"status": "passed", "detail": "3 compiled steps equal the eager steps"}


RUNS: dict[str, Callable[[], dict]] = {
    "kvcache": lambda: check_decode(paged=False),
    "kvcache_paged": lambda: check_decode(paged=True),
    "varlen": check_varlen,
    "fwd": lambda: check_dense(backward=False),
    "fwd_bwd": lambda: check_dense(backward=True),
    "compile": check_compile,
}


def run(checks=CHECKS, report=print) -> list:
    """Run the checks; one row per check: ``{"check", "status", "detail"}`` (status passed,
    failed or error)."""
    rows = []
    for name in checks:
        try:
            with use_backend("triton"):
                row = {"check": name, **RUNS[name]()}
        except Exception as exc:  # a capture that failed: reported, and the other checks go on
            row = {"check": name, "status": "error", "detail": f"{type(exc).__name__}: {exc}"[:400]}
        torch.cuda.synchronize()
        rows.append(row)
        report(f"{name:<14} {row['status']:<7} {row['detail']}")
    return rows


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.capture_check", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="append", choices=CHECKS, help="check to run (repeatable); default: all")
    parser.add_argument("--json", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("capture_check needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(args.check or CHECKS)
    if args.json:
        atomic_json.write_json(args.json, {"rows": rows})
    return 0 if all(row["status"] == "passed" for row in rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
