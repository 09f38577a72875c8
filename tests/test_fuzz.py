"""Differential fuzz test: random calls of every entry point against the plain-torch oracles.

Each case draws an entry point (``flash_attn_func``, the packed forms, ``flash_attn_varlen_func``
with and without ``block_table``, ``flash_attn_with_kvcache``, ``scaled_dot_product_attention``;
``test_fuzz_8bit``: the 8-bit ``sageattn`` under its names and ``sageattn_varlen``) and its
arguments (lengths including 0 and 1, odd head dims, GQA/MQA, windows in every accepted form,
softcap, ALiBi, scale, strided views of q/k/v and of the metadata, rotary, left padding, split-KV)
from ``random.Random(f"{seed}-{index}")`` (8-bit ones: ``random.Random(f"8bit-{seed}-{index}")``)
alone, and compares the result with ``tests/fuzz_oracle.py`` by the accuracy rule: max abs error at
most 2x (forward, log-sum-exp) or 3x (gradients) that of plain torch computing the same attention
in the input dtype, plus 1e-5, the truth computed in fp32 (fp64 for fp32 inputs). 8-bit attention
is held to its check (a) of docs/int8-attention.md: the same rule against fp64 attention of the
same quantized inputs (the method's torch definition, with the kernel's blocks), and refuses what
it must (training inputs, FP8 where the GPU lacks it) with ``NotImplementedError``. Inputs must
come back unchanged (the unused elements of strided views, NaN, included), a KV cache changed
exactly where the new keys go, forward-only paths (paged keys, KV cache) must run on inputs that
require grad and refuse ``.backward()`` with ``NotImplementedError``, and under the interpreter
every kernel load and store must stay inside the launch's tensors (``bounds_checked``).

    pytest tests/test_fuzz.py                                   # the bounded default count, seed 0
    pytest tests/test_fuzz.py --fuzz-cases 2000 --fuzz-seed 5   # more cases, another seed
    pytest tests/test_fuzz.py --fuzz-seed 0 --fuzz-case 17      # replay one case

Every failure message starts with its one-line replay command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import traceback
from typing import Callable

import fuzz_oracle as oracle
import numpy as np
import pytest
import torch

import flash_recipe
import flash_recipe.sage
from flash_recipe.ops import choose, limits
from flash_recipe.reference import compute_dtype
from flash_recipe.testing import FLOOR, accuracy_bound, max_error

HAS_CUDA = torch.cuda.is_available()
DEFAULT_CASES = 150  # about a minute on a 2-core CPU through the Triton interpreter

# Entry points and how often each is drawn.
KINDS = {
    "dense": 17,
    "qkvpacked": 5,
    "kvpacked": 5,
    "varlen": 12,
    "varlen_qkvpacked": 3,
    "varlen_kvpacked": 3,
    "paged": 13,
    "kvcache": 28,
    "sdpa": 14,
}
# 8-bit attention, drawn by ``test_fuzz_8bit`` from a stream of its own (``draw_8bit_case``), so
# that every (seed, index) of ``test_fuzz`` replays the case it always did: one 8-bit case for every
# EIGHT_BIT_SHARE attention cases.
EIGHT_BIT_KINDS = {"sage": 9, "sage_varlen": 5}
EIGHT_BIT_SHARE = 4
# The interpreter computes bf16 dot products wrongly: bf16 runs on a GPU only.
DTYPES = ("float16", "float32", "bfloat16") if HAS_CUDA else ("float16", "float32")
# A Triton case's backward path, drawn: each of the three (the one launch runs the three kernels
# where the device's table lacks its tiles: ``choose.backward_path``).
BACKWARD_PATHS = limits.BACKWARD_PATH_NAMES
# 8-bit attention takes 16-bit inputs; its only 16-bit products take fp16 operands, so bf16 runs
# under the interpreter too.
SAGE_DTYPES = ("float16", "bfloat16")
SAGE_NAMES = (  # sageattn, drawn most, and its path names (the P.V format fixed)
    "sageattn",
    "sageattn",
    "sageattn",
    "sageattn_qk_int8_pv_fp16_triton",
    "sageattn_qk_int8_pv_fp16_cuda",
    "sageattn_qk_int8_pv_fp8_cuda",
)
HEAD_DIMS = (1, 2, 3, 7, 8, 16, 24, 32, 40, 48, 59, 64)
RARE_HEAD_DIMS = (80, 96, 128)
SOFTCAPS = (0.3, 0.7, 1.0, 5.0, 50.0, 500.0)
# Strided views with a contiguous last dim (see ``Inputs.tensor``).
LAYOUTS = ("heads", "pad", "swap", "step", "offset")
TABLE_LAYOUTS = ("step", "colmajor", "rowpad")


# ----------------------------------------------------------------------------------------------
# Drawing a case: plain Python values only, so a case prints, and replays from (seed, index).
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One drawn call: ``kind`` (the entry point), dtype name, ``backend`` (None: automatic) and
    ``params``, every other choice in drawing order."""

    seed: int
    index: int
    kind: str
    dtype: str
    backend: str | None
    params: dict

    @property
    def replay(self) -> str:
        test = "::test_fuzz_8bit" if self.kind in EIGHT_BIT_KINDS else ""
        return f"python -m pytest tests/test_fuzz.py{test} --fuzz-seed {self.seed} --fuzz-case {self.index}"

    @property
    def id(self) -> str:
        p = self.params
        parts = [str(self.index), self.kind, self.dtype.replace("float", "fp"), p["shape"]]
        if p.get("causal"):
            parts.append("causal")
        if tuple(p.get("window", (-1, -1))) != (-1, -1):
            parts.append(f"win{p['window'][0]}:{p['window'][1]}-{p['window_form']}")
        if p.get("softcap"):
            parts.append(f"softcap{p['softcap']:g}")
        if p.get("alibi"):
            parts.append(f"alibi{p['alibi']}")
        if p.get("sink"):
            parts.append(f"sink{p['sink']}")
        if p.get("scale") is not None:
            parts.append("scale")
        for key, name in (("rotary", "rot"), ("table_layout", "table"), ("num_splits", "split")):
            if p.get(key):
                parts.append(f"{name}{p[key]}")
        if p.get("strided_meta"):
            parts.append("stridedmeta")
        if any(v != "contig" for k, v in p.items() if k.startswith("layout_")):
            parts.append("views")
        if p.get("api", "sageattn") != "sageattn" and self.kind == "sage":
            parts.append(p["api"].removeprefix("sageattn_"))
        if p.get("pv_dtype", "omit") != "omit":
            parts.append(f"pv{p['pv_dtype']}")
        if p.get("smooth_k") is False:
            parts.append("nosmooth")
        if p.get("k_offset"):
            parts.append(f"koffset{p['k_offset']:g}")
        if p.get("path"):
            parts.append(p["path"].replace("_", ""))
        for key in ("leftpad", "batch_idx", "lse", "backward", "grad"):
            if p.get(key):
                parts.append(key.replace("_", ""))
        if self.backend not in (None, "triton"):
            parts.append(self.backend)
        return "-".join(parts)

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if k != "torch_seed")
        return f"{self.kind} {self.dtype} backend={self.backend or 'auto'}: {fields}"


def _length(rng: random.Random, lo: int, hi: int) -> int:
    """A length in ``[lo, hi]``, often short."""
    return rng.randint(lo, min(hi, 8)) if rng.random() < 0.45 else rng.randint(lo, hi)


def _seq_lengths(rng: random.Random, batch: int, hi: int) -> list:
    """Packed-sequence lengths, with zeros and ones."""
    return [rng.choice((0, 1)) if rng.random() < 0.25 else _length(rng, 1, hi) for _ in range(batch)]


def _head_dim(rng: random.Random) -> int:
    return rng.choice(RARE_HEAD_DIMS) if rng.random() < 0.06 else rng.choice(HEAD_DIMS)


def _heads(rng: random.Random, p: dict, gqa: bool = True) -> None:
    nheads = rng.randint(1, 4)
    p["nheads"] = nheads
    p["nheads_k"] = rng.choice([h for h in range(1, nheads + 1) if nheads % h == 0]) if gqa else nheads
    p["head_dim"] = _head_dim(rng)


def _layout(rng: random.Random, extra: tuple = ()) -> str:
    return "contig" if rng.random() < 0.5 else rng.choice(LAYOUTS + extra)


def _scores(rng: random.Random, p: dict, seqlen_k: int) -> None:
    """The score options of the flash_attn_* entry points; ``seqlen_k`` is the longest key range."""
    p["causal"] = rng.random() < 0.4

    def side() -> int:
        r = rng.random()
        return -1 if r < 0.3 else 0 if r < 0.45 else rng.randint(1, 6) if r < 0.8 else seqlen_k + rng.randint(0, 9)

    p["window"] = (-1, -1) if rng.random() < 0.45 else (side(), side())
    forms = ("tuple", "list", "numpy", "tensor")
    p["window_form"] = "omit" if p["window"] == (-1, -1) and rng.random() < 0.6 else rng.choice(forms)
    p["softcap"] = 0.0 if rng.random() < 0.55 else rng.choice(SOFTCAPS)
    p["alibi"] = "" if rng.random() < 0.65 else rng.choice(("H", "BH", "BH-strided"))
    p["scale"] = None if rng.random() < 0.6 else round(rng.uniform(0.05, 1.2), 4)
    p["magnitude"] = rng.choice((1.0, 1.0, 1.0, 3.0))
    # Attention sinks: drawn around 0, very negative (no effect), very positive (rows near 0), or -inf.
    p["sink"] = "" if rng.random() < 0.7 else rng.choice(("N", "N", "low", "high", "-inf"))


def _draw_dense(rng: random.Random, p: dict, kind: str) -> None:
    p["batch"] = rng.randint(1, 3)
    p["seqlen_q"] = _length(rng, 1, 48)
    p["seqlen_k"] = p["seqlen_q"] if kind == "qkvpacked" or rng.random() < 0.3 else _length(rng, 1, 48)
    _heads(rng, p, gqa=kind != "qkvpacked")
    p["shape"] = f"B{p['batch']}-Sq{p['seqlen_q']}-Sk{p['seqlen_k']}-H{p['nheads']}-Hk{p['nheads_k']}-D{p['head_dim']}"
    names = {"dense": ("q", "k", "v"), "qkvpacked": ("qkv",), "kvpacked": ("q", "kv")}[kind]
    for name in names:
        p[f"layout_{name}"] = _layout(rng)
    _scores(rng, p, p["seqlen_k"])
    p["backward"] = rng.random() < 0.6
    p["lse"] = rng.random() < 0.4


def _draw_varlen(rng: random.Random, p: dict, kind: str) -> None:
    batch = rng.randint(1, 4)
    p["lengths_q"] = _seq_lengths(rng, batch, 40)
    same = kind == "varlen_qkvpacked" or rng.random() < 0.3
    p["lengths_k"] = list(p["lengths_q"]) if same else _seq_lengths(rng, batch, 40)
    p["max_extra"] = (0, 0) if rng.random() < 0.7 else (rng.randint(0, 7), rng.randint(0, 7))
    if kind == "varlen_qkvpacked":
        p["max_extra"] = (p["max_extra"][0], p["max_extra"][0])
    _heads(rng, p, gqa=kind != "varlen_qkvpacked")
    p["shape"] = (
        f"B{batch}-Tq{sum(p['lengths_q'])}-Tk{sum(p['lengths_k'])}-H{p['nheads']}-Hk{p['nheads_k']}-D{p['head_dim']}"
    )
    names = {"varlen": ("q", "k", "v"), "varlen_qkvpacked": ("qkv",), "varlen_kvpacked": ("q", "kv")}[kind]
    for name in names:
        p[f"layout_{name}"] = _layout(rng)
    p["strided_meta"] = rng.random() < 0.35
    _scores(rng, p, max(p["lengths_k"]) + sum(p["max_extra"]))
    p["backward"] = rng.random() < 0.6
    p["lse"] = rng.random() < 0.4


def _table_layout(rng: random.Random) -> str:
    return "" if rng.random() < 0.5 else rng.choice(TABLE_LAYOUTS)


def _draw_paged(rng: random.Random, p: dict) -> None:
    batch = rng.randint(1, 3)
    p["lengths_q"] = _seq_lengths(rng, batch, 32)
    p["lengths_k"] = _seq_lengths(rng, batch, 48)
    page = p["page_size"] = rng.choice((16, 16, 32, 48))
    width = max(1, -(-max(p["lengths_k"]) // page)) + int(rng.random() < 0.3)
    num_blocks = p["num_blocks"] = batch * width + rng.randint(0, 3)
    if rng.random() < 0.3:  # pages shared between sequences (read only, so allowed)
        p["block_table"] = [[rng.randrange(num_blocks) for _ in range(width)] for _ in range(batch)]
    else:
        pages = rng.sample(range(num_blocks), batch * width)
        p["block_table"] = [pages[b * width : (b + 1) * width] for b in range(batch)]
    p["max_extra"] = (0, 0) if rng.random() < 0.7 else (rng.randint(0, 7), rng.randint(0, 7))
    _heads(rng, p)
    p["shape"] = (
        f"B{batch}-Tq{sum(p['lengths_q'])}-Tk{sum(p['lengths_k'])}-page{page}x{num_blocks}-H{p['nheads']}"
        f"-Hk{p['nheads_k']}-D{p['head_dim']}"
    )
    for name in ("q", "k", "v"):
        p[f"layout_{name}"] = _layout(rng)
    p["table_layout"] = _table_layout(rng)
    p["strided_meta"] = rng.random() < 0.35
    _scores(rng, p, max(p["lengths_k"]) + p["max_extra"][1])
    p["grad"] = rng.random() < 0.25
    p["lse"] = rng.random() < 0.4


def _draw_kvcache(rng: random.Random, p: dict) -> None:
    batch = p["batch"] = rng.randint(1, 3)
    seqlen_q = p["seqlen_q"] = 1 if rng.random() < 0.5 else rng.randint(2, 12)
    _heads(rng, p)
    r = rng.random()
    p["new"] = 0 if r < 0.35 else seqlen_q if r < 0.75 else rng.randint(1, 8)
    if rng.random() < 0.4:  # paged
        page = p["page_size"] = rng.choice((16, 16, 32))
        width = rng.randint(max(1, -(-p["new"] // page)), 3)
        num_blocks = p["num_blocks"] = batch * width + rng.randint(0, 3)
        pages = rng.sample(range(num_blocks), batch * width)  # distinct: the new rows go to one place
        p["block_table"] = [pages[b * width : (b + 1) * width] for b in range(batch)]
        p["table_layout"] = _table_layout(rng)
        capacity = page * width
    else:
        capacity = p["seqlen_cache"] = rng.randint(max(1, p["new"]), 48)
        if rng.random() < 0.4:
            entries = p["batch_cache"] = batch + rng.randint(0, 3)
            if p["new"] or rng.random() < 0.5:
                p["batch_idx"] = rng.sample(range(entries), batch)
            else:  # without new keys nothing is written, so entries may repeat
                p["batch_idx"] = [rng.randrange(entries) for _ in range(batch)]
        else:
            p["batch_cache"] = batch
    room = capacity - p["new"]
    r = rng.random()
    if p["new"] == 0 and r < 0.1:
        p["seqlens_form"], p["seqlens"] = "none", [capacity] * batch
    elif r < 0.3:
        p["seqlens_form"], p["seqlens"] = "int", [rng.randint(0, room)] * batch
    else:
        p["seqlens_form"], p["seqlens"] = "tensor", [rng.randint(0, room) for _ in range(batch)]
    if rng.random() < 0.3:
        p["leftpad"] = [rng.randint(0, n) for n in p["seqlens"]]
    cache = f"page{p['page_size']}x{p['num_blocks']}" if "page_size" in p else f"cache{p['batch_cache']}x{capacity}"
    p["shape"] = f"B{batch}-Sq{seqlen_q}-new{p['new']}-{cache}-H{p['nheads']}-Hk{p['nheads_k']}-D{p['head_dim']}"
    for name in ("q", "cache", "new"):
        p[f"layout_{name}"] = _layout(rng)
    p["strided_meta"] = rng.random() < 0.35
    _scores(rng, p, capacity)
    if p["new"] and rng.random() < 0.5:
        dims = [r for r in range(2, p["head_dim"] + 1, 2)]
        if dims:
            sixteens = [r for r in dims if r % 16 == 0]
            p["rotary"] = rng.choice(sixteens) if sixteens and rng.random() < 0.5 else rng.choice(dims)
            p["interleaved"] = rng.random() < 0.5
            p["rotary_dtype"] = rng.choice(("q", "float32"))
            moves = p["causal"] or p["window"] != (-1, -1)
            last = max(p["seqlens"]) + max(p["new"], seqlen_q if moves else 1)
            p["seqlen_rotary"] = last + rng.randint(0, 8)
    p["num_splits"] = rng.choice((0, 1, 1, 2, 3, 7))
    p["grad"] = rng.random() < 0.2
    p["lse"] = rng.random() < 0.5


def _draw_sdpa(rng: random.Random, p: dict) -> None:
    p["unbatched"] = rng.random() < 0.25
    p["batch"] = 1 if p["unbatched"] else rng.randint(1, 3)
    p["seqlen_q"] = _length(rng, 1, 48)
    p["seqlen_k"] = p["seqlen_q"] if rng.random() < 0.3 else _length(rng, 1, 48)
    p["enable_gqa"] = rng.random() < 0.4
    _heads(rng, p, gqa=p["enable_gqa"])
    p["head_dim_v"] = p["head_dim"] if rng.random() < 0.85 else _head_dim(rng)
    batch = "" if p["unbatched"] else f"B{p['batch']}-"
    p["shape"] = (
        f"{batch}Sq{p['seqlen_q']}-Sk{p['seqlen_k']}"
        f"-H{p['nheads']}-Hk{p['nheads_k']}-D{p['head_dim']}-Dv{p['head_dim_v']}"
    )
    for name in ("q", "k", "v"):  # SDPA also takes a strided last dim (it is copied)
        p[f"layout_{name}"] = _layout(rng, extra=("lastdim",))
    p["causal"] = rng.random() < 0.4
    p["scale"] = None if rng.random() < 0.6 else round(rng.uniform(0.05, 1.2), 4)
    p["magnitude"] = rng.choice((1.0, 1.0, 1.0, 3.0))
    p["backward"] = rng.random() < 0.6


def _draw_sage(rng: random.Random, p: dict, kind: str) -> None:
    """8-bit attention: ``sageattn`` (a name of it, a layout) or ``sageattn_varlen``; lengths long
    enough to cross the quantization blocks, K sometimes with a large common offset per channel
    (what smoothing removes)."""
    if kind == "sage":
        p["api"] = rng.choice(SAGE_NAMES)
        p["tensor_layout"] = rng.choice(("HND", "NHD"))
        p["batch"] = rng.randint(1, 3)
        p["seqlen_q"] = _length(rng, 1, 80)
        p["seqlen_k"] = p["seqlen_q"] if rng.random() < 0.3 else _length(rng, 1, 80)
        _heads(rng, p)
        p["shape"] = (
            f"{p['tensor_layout']}-B{p['batch']}-Sq{p['seqlen_q']}-Sk{p['seqlen_k']}"
            f"-H{p['nheads']}-Hk{p['nheads_k']}-D{p['head_dim']}"
        )
        p["lse"] = rng.random() < 0.4
    else:
        p["api"] = "sageattn_varlen"
        batch = rng.randint(1, 4)
        p["lengths_q"] = _seq_lengths(rng, batch, 70)
        p["lengths_k"] = list(p["lengths_q"]) if rng.random() < 0.3 else _seq_lengths(rng, batch, 70)
        p["max_extra"] = (0, 0) if rng.random() < 0.7 else (rng.randint(0, 7), rng.randint(0, 7))
        _heads(rng, p)
        p["shape"] = (
            f"B{batch}-Tq{sum(p['lengths_q'])}-Tk{sum(p['lengths_k'])}"
            f"-H{p['nheads']}-Hk{p['nheads_k']}-D{p['head_dim']}"
        )
        p["strided_meta"] = rng.random() < 0.35
    for name in ("q", "k", "v"):
        p[f"layout_{name}"] = _layout(rng)
    p["causal"] = rng.random() < 0.4
    p["scale"] = None if rng.random() < 0.6 else round(rng.uniform(0.05, 1.2), 4)
    p["magnitude"] = rng.choice((1.0, 1.0, 1.0, 3.0))
    p["k_offset"] = rng.choice((0.0, 0.0, 4.0, 16.0))
    p["smooth_k"] = rng.choice(("omit", "omit", True, False))
    p["pv_dtype"] = "omit"
    if p["api"] in ("sageattn", "sageattn_varlen") and rng.random() < 0.4:
        p["pv_dtype"] = rng.choice(("fp16", "fp8"))
    p["grad"] = rng.random() < 0.08


def draw_8bit_case(seed: int, index: int) -> Case:
    """8-bit case ``index`` of ``seed``: a function of the two alone, from its own stream. One path:
    the 8-bit kernels (or, where Triton cannot run, their torch fallback)."""
    rng = random.Random(f"8bit-{seed}-{index}")
    kind = rng.choices(list(EIGHT_BIT_KINDS), weights=list(EIGHT_BIT_KINDS.values()))[0]
    dtype = rng.choice(SAGE_DTYPES)
    p = {"torch_seed": rng.getrandbits(62)}
    _draw_sage(rng, p, kind)
    return Case(seed, index, kind, dtype, None, p)


def draw_case(seed: int, index: int) -> Case:
    """Case ``index`` of ``seed``: a function of the two alone."""
    rng = random.Random(f"{seed}-{index}")
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    dtype = rng.choice(DTYPES)
    p = {"torch_seed": rng.getrandbits(62)}
    if kind in ("dense", "qkvpacked", "kvpacked"):
        _draw_dense(rng, p, kind)
    elif kind.startswith("varlen"):
        _draw_varlen(rng, p, kind)
    elif kind == "paged":
        _draw_paged(rng, p)
    elif kind == "kvcache":
        _draw_kvcache(rng, p)
    else:
        _draw_sdpa(rng, p)
    # Mostly the Triton kernels; sometimes the torch backends, where they can run the call.
    r = rng.random()
    backend = "triton"
    if kind == "sdpa" and p["head_dim_v"] != p["head_dim"]:
        backend = "auto"  # the kernels need equal head dims; the call goes to torch
    elif r < 0.1:
        backend = "reference"
    elif r < 0.2 and not p.get("softcap") and not p.get("lse") and not p.get("sink"):
        backend = "sdpa"
    if backend == "triton":  # the backward path, drawn last so that every earlier choice replays as it did
        p["path"] = rng.choice(BACKWARD_PATHS)
    return Case(seed, index, kind, dtype, None if backend == "auto" else backend, p)


# ----------------------------------------------------------------------------------------------
# Building the inputs.
# ----------------------------------------------------------------------------------------------


class Inputs:
    """Builds the tensors of one case from its torch generator and remembers every tensor's backing
    storage, so that the test can check afterwards that nothing was written where it should not be."""

    def __init__(self, case: Case, device: torch.device):
        self.gen = torch.Generator().manual_seed(case.params["torch_seed"])
        self.dtype = getattr(torch, case.dtype)
        self.device = device
        self.magnitude = case.params.get("magnitude", 1.0)
        self.bases: dict = {}  # name -> (view, base, snapshot of base)

    def _keep(self, name: str, view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        self.bases[name] = (view, base, base.clone())
        return view

    def keep(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Remember a tensor made elsewhere (its own storage)."""
        return self._keep(name, t, t)

    def tensor(self, name: str, shape: tuple, layout: str, offset: float = 0.0) -> torch.Tensor:
        """Random values ``shape`` in a container given by ``layout``, whose other elements are NaN:
        ``contig``; ``heads`` a slice of dim -2; ``pad`` the first entries of a longer last dim; ``swap``
        dims -3 and -2 transposed in memory; ``step`` every other index of dim -3; ``offset`` dim 0 after
        an extra leading entry; ``lastdim`` the last two dims transposed in memory (last dim strided).
        ``offset``: plus a common value per channel (last dim), drawn with that standard deviation."""
        values = torch.randn(shape, generator=self.gen) * self.magnitude
        if offset:
            values = values + torch.randn(shape[-1], generator=self.gen) * offset
        values = values.to(self.dtype).to(self.device)
        big = list(shape)
        if layout == "contig":
            base = values.clone()
            return self._keep(name, base, base)
        if layout == "heads":
            big[-2] += 2
        elif layout == "pad":
            big[-1] += 5
        elif layout == "swap" and len(shape) >= 3:
            big[-3], big[-2] = big[-2], big[-3]
        elif layout == "step" and len(shape) >= 3:
            big[-3] *= 2
        elif layout == "lastdim":
            big[-2], big[-1] = big[-1], big[-2]
        else:  # offset (and the 2-d forms of swap / step)
            big[0] += 1
        base = torch.full(big, float("nan"), dtype=self.dtype, device=self.device)
        if layout == "heads":
            view = base.narrow(-2, 1, shape[-2])
        elif layout == "pad":
            view = base[..., : shape[-1]]
        elif layout == "swap" and len(shape) >= 3:
            view = base.transpose(-3, -2)
        elif layout == "step" and len(shape) >= 3:
            view = base.unflatten(-3, (shape[-3], 2)).select(-3, 0)
        elif layout == "lastdim":
            view = base.transpose(-2, -1)
        else:
            view = base.narrow(0, 1, shape[0])
        view.copy_(values)
        return self._keep(name, view, base)

    def index(self, name: str, values: list, strided: bool, garbage_hi: int) -> torch.Tensor:
        """int32 ``values`` on the device; ``strided``: every other entry of a longer tensor whose other
        entries are valid-looking wrong values in ``[0, garbage_hi]``."""
        exact = torch.tensor(values, dtype=torch.int32)
        if not strided:
            return self._keep(name, exact.to(self.device), exact.to(self.device))
        base = torch.randint(0, garbage_hi + 1, (2 * len(values),), generator=self.gen, dtype=torch.int32)
        base[::2] = exact
        base = base.to(self.device)
        return self._keep(name, base[::2], base)

    def table(self, name: str, rows: list, layout: str, num_blocks: int) -> torch.Tensor:
        """A block table ``(B, width)`` int32: contiguous (``""``), every other column of a wider table
        (``step``, the other columns valid-looking wrong pages), column-major (``colmajor``), or the first
        columns of a wider table (``rowpad``)."""
        exact = torch.tensor(rows, dtype=torch.int32)
        batch, width = exact.shape
        if layout == "step":
            base = torch.randint(0, num_blocks, (batch, 2 * width), generator=self.gen, dtype=torch.int32)
            base[:, ::2] = exact
            base = base.to(self.device)
            return self._keep(name, base[:, ::2], base)
        if layout == "colmajor":
            base = exact.t().contiguous().to(self.device)
            return self._keep(name, base.t(), base)
        if layout == "rowpad":
            base = torch.randint(0, num_blocks, (batch, width + 3), generator=self.gen, dtype=torch.int32)
            base[:, :width] = exact
            base = base.to(self.device)
            return self._keep(name, base[:, :width], base)
        exact = exact.to(self.device)
        return self._keep(name, exact, exact)

    def slopes(self, kind: str, batch: int, nheads: int) -> torch.Tensor | None:
        """ALiBi slopes float32: ``(H,)``, ``(B, H)``, or ``(B, H)`` as a slice of a wider tensor."""
        if not kind:
            return None
        shape = (nheads,) if kind == "H" else (batch, nheads)
        values = (torch.rand(shape, generator=self.gen) * 0.9 + 0.05).to(self.device)
        if kind == "BH-strided":
            base = torch.full((batch, nheads + 3), float("nan"), device=self.device)
            base[:, 1 : nheads + 1] = values
            return self._keep("alibi_slopes", base[:, 1 : nheads + 1], base)
        return self._keep("alibi_slopes", values, values)

    def sinks(self, kind: str, nheads: int) -> torch.Tensor | None:
        """Attention sinks ``(H,)`` in the inputs' dtype (as a model holds them): ``N`` standard normal,
        ``low`` about -30, ``high`` about +12, ``-inf``; None for ``""``."""
        if not kind:
            return None
        values = torch.randn(nheads, generator=self.gen) + {"N": 0.0, "low": -30.0, "high": 12.0, "-inf": 0.0}[kind]
        if kind == "-inf":
            values = torch.full((nheads,), float("-inf"))
        values = values.to(dtype=self.dtype, device=self.device)
        return self._keep("learnable_sink", values, values)

    def randn_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=self.gen).to(dtype=t.dtype, device=t.device)

    def unchanged(self, skip: tuple = ()) -> list:
        """Names of the remembered tensors whose storage changed (bit for bit)."""
        return [
            name
            for name, (_, base, before) in self.bases.items()
            if name not in skip and not torch.equal(_bits(base), _bits(before))
        ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its size (NaN equals NaN, -0 differs from 0)."""
    t = t.detach()
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _window_arg(window: tuple, form: str):
    """``window_size`` as the case passes it: a tuple, a list, numpy ints or an int tensor."""
    if form == "list":
        return list(window)
    if form == "numpy":
        return tuple(np.int64(w) for w in window)
    if form == "tensor":
        return torch.tensor(window)
    return tuple(window)


def _score_options(p: dict, head_dim: int, slopes: torch.Tensor | None, sinks: torch.Tensor | None = None) -> tuple:
    """``(kwargs for the flash_attn_* call, oracle.Scores)``; the oracle takes the sinks as an argument
    (``Scores.with_sinks``), so that they are a leaf of its graph like q, k and v."""
    kwargs = {"causal": p["causal"], "softcap": p["softcap"], "alibi_slopes": slopes}
    if sinks is not None:
        kwargs["learnable_sink"] = sinks
    if p["scale"] is not None:
        kwargs["softmax_scale"] = p["scale"]
    if p["window_form"] != "omit":
        kwargs["window_size"] = _window_arg(p["window"], p["window_form"])
    scale = head_dim**-0.5 if p["scale"] is None else p["scale"]
    return kwargs, oracle.Scores(scale, p["causal"], tuple(p["window"]), p["softcap"], slopes)


def _offsets(lengths: list) -> list:
    return [0, *np.cumsum(lengths).tolist()]


# ----------------------------------------------------------------------------------------------
# Comparing.
# ----------------------------------------------------------------------------------------------


class Report:
    """Every comparison of one case, one line each; ``problems`` are the failing ones."""

    def __init__(self):
        self.lines: list = []
        self.problems: list = []

    def fail(self, line: str) -> None:
        self.lines.append(f"FAIL {line}")
        self.problems.append(line)

    def rule(self, name: str, got: torch.Tensor, truth: torch.Tensor, same: torch.Tensor, factor: int) -> None:
        """The accuracy rule: ``max|got - truth| <= factor * max|same - truth| + 1e-5``; entries where the
        truth is infinite (lse of a row that sees no key) must match it exactly."""
        if tuple(got.shape) != tuple(truth.shape):
            self.fail(f"{name}: shape {tuple(got.shape)}, expected {tuple(truth.shape)}")
            return
        got, truth, same = (t.detach().double().cpu() for t in (got, truth, same))
        finite = torch.isfinite(truth)
        if not torch.equal(got[~finite], truth[~finite]):
            self.fail(
                f"{name}: {int((got[~finite] != truth[~finite]).sum())} entries differ where the truth is infinite"
            )
        if not torch.isfinite(same[finite]).all():
            self.fail(f"{name}: the input-precision torch computation is not finite (oracle problem)")
            return
        bad = int((~torch.isfinite(got[finite])).sum())
        err = math.inf if bad else (got[finite] - truth[finite]).abs().max().item() if finite.any() else 0.0
        bound = accuracy_bound(max_error(same[finite], truth[finite]), factor)
        line = (
            f"{name}: max error {err:.3g}{f' ({bad} entries NaN or infinite)' if bad else ''} vs bound "
            f"{bound:.3g} ({factor}x torch in the input dtype + {FLOOR:g})"
        )
        if err <= bound:
            self.lines.append(f"ok   {line}")
        else:
            self.fail(line)

    def check(self, ok: bool, line: str) -> None:
        if ok:
            self.lines.append(f"ok   {line}")
        else:
            self.fail(line)


def _backend(case: Case):
    return flash_recipe.use_backend(case.backend) if case.backend else contextlib.nullcontext()


def _differential(report: Report, inputs: Inputs, call: Callable, fn: Callable, tensors: dict, backward: bool) -> None:
    """Run ``call()`` -> ``(out, lse or None)`` and ``fn(**tensors)`` -> ``(out, lse)`` (an oracle) in the
    truth's precision and in the input dtype, and compare the outputs, the lse and (``backward``) the
    gradients with respect to ``tensors`` under the accuracy rule."""
    for t in tensors.values():
        t.requires_grad_(backward)
    out, lse = call()
    report.check(out.dtype == inputs.dtype, f"out dtype {out.dtype}")
    high = compute_dtype(inputs.dtype, upcast=True)  # fp32 for 16-bit inputs, fp64 for fp32
    truth_in = {n: t.detach().to(high).requires_grad_(backward) for n, t in tensors.items()}
    same_in = {n: t.detach().clone().requires_grad_(backward) for n, t in tensors.items()}
    truth_out, truth_lse = fn(**truth_in)
    same_out, same_lse = fn(**same_in)
    report.rule("out", out, truth_out, same_out, 2)
    if lse is not None:
        report.rule("lse", lse, truth_lse, same_lse, 2)
    if backward:
        dout = inputs.randn_like(out)
        grads = _grads(out, tensors, dout)
        truth_grads = _grads(truth_out, truth_in, dout.to(high))
        same_grads = _grads(same_out, same_in, dout)
        for name in tensors:
            report.rule(f"d{name}", grads[name], truth_grads[name], same_grads[name], 3)


def _grads(out: torch.Tensor, tensors: dict, dout: torch.Tensor) -> dict:
    grads = torch.autograd.grad(out, list(tensors.values()), dout, allow_unused=True)
    return {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(tensors.items(), grads)}


def _forward_only(report: Report, inputs: Inputs, call: Callable, fn: Callable, tensors: dict, grad: bool) -> tuple:
    """A forward-only path: with ``grad`` the inputs require grad, the forward must run and
    ``.backward()`` must raise ``NotImplementedError``. Compares out and lse; returns the oracle's truth
    and input-dtype results ``(truth, same)``, each ``fn``'s full return value."""
    for t in tensors.values():
        t.requires_grad_(grad)
    out, lse = call()
    report.check(out.dtype == inputs.dtype, f"out dtype {out.dtype}")
    high = compute_dtype(inputs.dtype, upcast=True)  # fp32 for 16-bit inputs, fp64 for fp32
    with torch.no_grad():
        truth = fn(**{n: t.detach().to(high) for n, t in tensors.items()})
        same = fn(**{n: t.detach() for n, t in tensors.items()})
    report.rule("out", out, truth[0], same[0], 2)
    if lse is not None:
        report.rule("lse", lse, truth[1], same[1], 2)
    if grad:
        try:
            out.sum().backward()
        except NotImplementedError:
            report.check(True, "backward raises NotImplementedError")
        except Exception as exc:  # noqa: BLE001 - the wrong kind of error is the finding
            report.fail(f"backward raised {type(exc).__name__} ({exc}), expected NotImplementedError")
        else:
            report.fail("backward ran, expected NotImplementedError (forward-only path)")
    return truth, same


# ----------------------------------------------------------------------------------------------
# The entry points.
# ----------------------------------------------------------------------------------------------


def _run_dense(case: Case, inputs: Inputs, report: Report) -> None:
    p = case.params
    b, sq, sk, h, hk, d = (p[n] for n in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "head_dim"))
    slopes = inputs.slopes(p["alibi"], b, h)
    sinks = inputs.sinks(p.get("sink", ""), h)
    kwargs, opts = _score_options(p, d, slopes, sinks)
    kwargs["return_attn_probs"] = p["lse"]

    def result(r):
        return (r[0], r[1]) if p["lse"] else (r, None)

    if case.kind == "dense":
        tensors = {
            "q": inputs.tensor("q", (b, sq, h, d), p["layout_q"]),
            "k": inputs.tensor("k", (b, sk, hk, d), p["layout_k"]),
            "v": inputs.tensor("v", (b, sk, hk, d), p["layout_v"]),
        }

        def call():
            with _backend(case):
                return result(flash_recipe.flash_attn_func(tensors["q"], tensors["k"], tensors["v"], **kwargs))

        def fn(q, k, v, learnable_sink=None):
            return oracle.dense(q, k, v, opts.with_sinks(learnable_sink))
    elif case.kind == "qkvpacked":
        tensors = {"qkv": inputs.tensor("qkv", (b, sq, 3, h, d), p["layout_qkv"])}

        def call():
            with _backend(case):
                return result(flash_recipe.flash_attn_qkvpacked_func(tensors["qkv"], **kwargs))

        def fn(qkv, learnable_sink=None):
            return oracle.dense(*qkv.unbind(2), opts.with_sinks(learnable_sink))
    else:
        tensors = {
            "q": inputs.tensor("q", (b, sq, h, d), p["layout_q"]),
            "kv": inputs.tensor("kv", (b, sk, 2, hk, d), p["layout_kv"]),
        }

        def call():
            with _backend(case):
                return result(flash_recipe.flash_attn_kvpacked_func(tensors["q"], tensors["kv"], **kwargs))

        def fn(q, kv, learnable_sink=None):
            return oracle.dense(q, *kv.unbind(2), opts.with_sinks(learnable_sink))

    if sinks is not None:
        tensors["learnable_sink"] = sinks
    _differential(report, inputs, call, fn, tensors, p["backward"])


def _run_varlen(case: Case, inputs: Inputs, report: Report) -> None:
    p = case.params
    lq, lk, h, hk, d = (p[n] for n in ("lengths_q", "lengths_k", "nheads", "nheads_k", "head_dim"))
    cu_q, cu_k = _offsets(lq), _offsets(lk)
    tq, tk = cu_q[-1], cu_k[-1]
    max_q, max_k = max(lq) + p["max_extra"][0], max(lk) + p["max_extra"][1]
    cu_q_t = inputs.index("cu_seqlens_q", cu_q, p["strided_meta"], tq)
    cu_k_t = cu_q_t if case.kind == "varlen_qkvpacked" else inputs.index("cu_seqlens_k", cu_k, p["strided_meta"], tk)
    slopes = inputs.slopes(p["alibi"], len(lq), h)
    sinks = inputs.sinks(p.get("sink", ""), h)
    kwargs, opts = _score_options(p, d, slopes, sinks)
    kwargs["return_attn_probs"] = p["lse"]

    def result(r):
        return (r[0], r[1]) if p["lse"] else (r, None)

    if case.kind == "varlen":
        tensors = {
            "q": inputs.tensor("q", (tq, h, d), p["layout_q"]),
            "k": inputs.tensor("k", (tk, hk, d), p["layout_k"]),
            "v": inputs.tensor("v", (tk, hk, d), p["layout_v"]),
        }

        def call():
            with _backend(case):
                return result(
                    flash_recipe.flash_attn_varlen_func(
                        tensors["q"], tensors["k"], tensors["v"], cu_q_t, cu_k_t, max_q, max_k, **kwargs
                    )
                )

        def fn(q, k, v, learnable_sink=None):
            return oracle.varlen(q, k, v, cu_q, cu_k, opts.with_sinks(learnable_sink))
    elif case.kind == "varlen_qkvpacked":
        tensors = {"qkv": inputs.tensor("qkv", (tq, 3, h, d), p["layout_qkv"])}

        def call():
            with _backend(case):
                return result(flash_recipe.flash_attn_varlen_qkvpacked_func(tensors["qkv"], cu_q_t, max_q, **kwargs))

        def fn(qkv, learnable_sink=None):
            return oracle.varlen(*qkv.unbind(1), cu_q, cu_q, opts.with_sinks(learnable_sink))
    else:
        tensors = {
            "q": inputs.tensor("q", (tq, h, d), p["layout_q"]),
            "kv": inputs.tensor("kv", (tk, 2, hk, d), p["layout_kv"]),
        }

        def call():
            with _backend(case):
                return result(
                    flash_recipe.flash_attn_varlen_kvpacked_func(
                        tensors["q"], tensors["kv"], cu_q_t, cu_k_t, max_q, max_k, **kwargs
                    )
                )

        def fn(q, kv, learnable_sink=None):
            return oracle.varlen(q, *kv.unbind(1), cu_q, cu_k, opts.with_sinks(learnable_sink))

    if sinks is not None:
        tensors["learnable_sink"] = sinks
    _differential(report, inputs, call, fn, tensors, p["backward"])


def _run_paged(case: Case, inputs: Inputs, report: Report) -> None:
    p = case.params
    lq, lk, h, hk, d = (p[n] for n in ("lengths_q", "lengths_k", "nheads", "nheads_k", "head_dim"))
    cu_q, cu_k = _offsets(lq), _offsets(lk)
    pages = (p["num_blocks"], p["page_size"], hk, d)
    tensors = {
        "q": inputs.tensor("q", (cu_q[-1], h, d), p["layout_q"]),
        "k": inputs.tensor("k", pages, p["layout_k"]),
        "v": inputs.tensor("v", pages, p["layout_v"]),
    }
    cu_q_t = inputs.index("cu_seqlens_q", cu_q, p["strided_meta"], cu_q[-1])
    cu_k_t = inputs.index("cu_seqlens_k", cu_k, p["strided_meta"], cu_k[-1])
    table = inputs.table("block_table", p["block_table"], p["table_layout"], p["num_blocks"])
    slopes = inputs.slopes(p["alibi"], len(lq), h)
    sinks = inputs.sinks(p.get("sink", ""), h)
    kwargs, opts = _score_options(p, d, slopes, sinks)
    kwargs["return_attn_probs"] = p["lse"]
    if sinks is not None:
        tensors["learnable_sink"] = sinks
    max_q, max_k = max(lq) + p["max_extra"][0], max(lk) + p["max_extra"][1]

    def call():
        with _backend(case):
            r = flash_recipe.flash_attn_varlen_func(
                tensors["q"], tensors["k"], tensors["v"], cu_q_t, cu_k_t, max_q, max_k, block_table=table, **kwargs
            )
        return (r[0], r[1]) if p["lse"] else (r, None)

    def fn(q, k, v, learnable_sink=None):
        return oracle.paged_varlen(q, k, v, cu_q, lk, p["block_table"], opts.with_sinks(learnable_sink))

    _forward_only(report, inputs, call, fn, tensors, p["grad"])


def _run_sdpa(case: Case, inputs: Inputs, report: Report) -> None:
    p = case.params
    b, sq, sk, h, hk, d, dv = (
        p[n] for n in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_k", "head_dim", "head_dim_v")
    )
    lead = () if p["unbatched"] else (b,)
    tensors = {
        "query": inputs.tensor("query", (*lead, h, sq, d), p["layout_q"]),
        "key": inputs.tensor("key", (*lead, hk, sk, d), p["layout_k"]),
        "value": inputs.tensor("value", (*lead, hk, sk, dv), p["layout_v"]),
    }
    kwargs = {"is_causal": p["causal"], "enable_gqa": p["enable_gqa"]}
    if p["scale"] is not None:
        kwargs["scale"] = p["scale"]
    scale = d**-0.5 if p["scale"] is None else p["scale"]

    def call():
        with _backend(case):
            return flash_recipe.scaled_dot_product_attention(**tensors, **kwargs), None

    def fn(query, key, value):
        if p["unbatched"]:
            return oracle.sdpa(query[None], key[None], value[None], scale, p["causal"])[0], None
        return oracle.sdpa(query, key, value, scale, p["causal"]), None

    _differential(report, inputs, call, fn, tensors, p["backward"])


def _run_kvcache(case: Case, inputs: Inputs, report: Report) -> None:
    p = case.params
    b, sq, new, h, hk, d = (p[n] for n in ("batch", "seqlen_q", "new", "nheads", "nheads_k", "head_dim"))
    paged = "page_size" in p
    if paged:
        cache_shape = (p["num_blocks"], p["page_size"], hk, d)
        table_rows = p["block_table"]
    else:
        cache_shape = (p["batch_cache"], p["seqlen_cache"], hk, d)
        table_rows = [[i] for i in p.get("batch_idx", range(b))]
    q = inputs.tensor("q", (b, sq, h, d), p["layout_q"])
    k_cache = inputs.tensor("k_cache", cache_shape, p["layout_cache"])
    v_cache = inputs.tensor("v_cache", cache_shape, p["layout_cache"])
    tensors = {"q": q}
    if new:
        tensors["k"] = inputs.tensor("k", (b, new, hk, d), p["layout_new"])
        tensors["v"] = inputs.tensor("v", (b, new, hk, d), p["layout_new"])
    slopes = inputs.slopes(p["alibi"], b, h)
    sinks = inputs.sinks(p.get("sink", ""), h)
    kwargs, opts = _score_options(p, d, slopes, sinks)
    if sinks is not None:
        tensors["learnable_sink"] = sinks
    kwargs.update(num_splits=p["num_splits"], return_softmax_lse=p["lse"])
    strided = p["strided_meta"]
    room = max(1, (p["page_size"] * len(table_rows[0]) if paged else p["seqlen_cache"]) - new)
    if p["seqlens_form"] == "tensor":
        kwargs["cache_seqlens"] = inputs.index("cache_seqlens", p["seqlens"], strided, room)
    elif p["seqlens_form"] == "int":
        kwargs["cache_seqlens"] = p["seqlens"][0]
    if "leftpad" in p:
        kwargs["cache_leftpad"] = inputs.index("cache_leftpad", p["leftpad"], strided, min(p["seqlens"]))
    if paged:
        kwargs["block_table"] = inputs.table("block_table", table_rows, p["table_layout"], p["num_blocks"])
    elif "batch_idx" in p:
        kwargs["cache_batch_idx"] = inputs.index("cache_batch_idx", p["batch_idx"], strided, p["batch_cache"] - 1)
    rotary = None
    if p.get("rotary"):
        angle = torch.rand(p["seqlen_rotary"], p["rotary"] // 2, generator=inputs.gen) * (2 * math.pi) - math.pi
        rot_dtype = inputs.dtype if p["rotary_dtype"] == "q" else torch.float32
        cos, sin = (
            inputs.keep(name, t.to(rot_dtype).to(inputs.device))
            for name, t in (("rotary_cos", angle.cos()), ("rotary_sin", angle.sin()))
        )
        kwargs.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=p["interleaved"])
        rotary = (cos, sin, p["interleaved"])
    layout = oracle.CacheLayout(table_rows, p["seqlens"], p.get("leftpad", [0] * b))
    k_before, v_before = k_cache.detach().clone(), v_cache.detach().clone()

    def call():
        with _backend(case):
            r = flash_recipe.flash_attn_with_kvcache(q, k_cache, v_cache, tensors.get("k"), tensors.get("v"), **kwargs)
        return r if p["lse"] else (r, None)

    def fn(q, k=None, v=None, learnable_sink=None):
        return oracle.kvcache(q, k_before, v_before, k, v, layout, opts.with_sinks(learnable_sink), rotary)

    truth, _ = _forward_only(report, inputs, call, fn, tensors, p["grad"])
    _check_cache(report, inputs, p, table_rows, truth)


def _check_cache(report: Report, inputs: Inputs, p: dict, table_rows: list, truth: tuple) -> None:
    """The caches changed exactly at the new rows: v bit for bit, k too without rotary, and with rotary
    within one rounding of the truth's rotated keys (``eps * max(1, max|k|) + 1e-5``)."""
    new = p["new"]
    page_size = p.get("page_size", p.get("seqlen_cache"))
    for name, rows in (("k_cache", truth[2]), ("v_cache", truth[3])):
        view, base, before = inputs.bases[name]
        expected = before.clone()
        exp_view = expected.as_strided(view.size(), view.stride(), view.storage_offset())
        written = torch.zeros(base.shape, dtype=torch.bool, device=base.device)
        written_view = written.as_strided(view.size(), view.stride(), view.storage_offset())
        want = torch.zeros(base.shape, dtype=torch.float64, device=base.device)
        want_view = want.as_strided(view.size(), view.stride(), view.storage_offset())
        for b, start in enumerate(p["seqlens"] if new else []):
            slots = torch.arange(start, start + new)
            pages = torch.tensor(table_rows[b])[slots // page_size]
            exp_view[pages, slots % page_size] = rows[b].to(inputs.dtype)
            written_view[pages, slots % page_size] = True
            want_view[pages, slots % page_size] = rows[b].double()
        rotated = name == "k_cache" and p.get("rotary")
        exact = ~written if rotated else torch.ones_like(written)
        same = torch.equal(_bits(base)[exact], _bits(expected)[exact])
        report.check(
            same,
            f"{name}: {'rows other than the new ones' if rotated else 'every row'} as expected "
            f"(bit for bit, padding of strided views included)",
        )
        if rotated and written.any():
            err = (base.double() - want)[written].abs().max().item()
            bound = torch.finfo(inputs.dtype).eps * max(1.0, want[written].abs().max().item()) + FLOOR
            report.check(err <= bound, f"{name}: new rotated rows, max error {err:.3g} vs bound {bound:.3g}")


def _run_sage(case: Case, inputs: Inputs, report: Report) -> None:
    """8-bit attention: check (a) against ``oracle.sage``, or the refusal the case must get."""
    from flash_recipe.ops import int8_attention, targets  # imports Triton: on a drawn 8-bit case only

    p = case.params
    h, hk, d = p["nheads"], p["nheads_k"], p["head_dim"]
    varlen = case.kind == "sage_varlen"
    kwargs = {"is_causal": p["causal"]}
    if p["scale"] is not None:
        kwargs["sm_scale"] = p["scale"]
    if p["smooth_k"] != "omit":
        kwargs["smooth_k"] = p["smooth_k"]
    if p["pv_dtype"] != "omit":
        kwargs["pv_dtype"] = p["pv_dtype"]
    if varlen:
        lq, lk = p["lengths_q"], p["lengths_k"]
        cu_q, cu_k = _offsets(lq), _offsets(lk)
        shapes = {"q": (cu_q[-1], h, d), "k": (cu_k[-1], hk, d), "v": (cu_k[-1], hk, d)}
        max_q, max_k = max(lq) + p["max_extra"][0], max(lk) + p["max_extra"][1]
        cu_q_t = inputs.index("cu_seqlens_q", cu_q, p["strided_meta"], cu_q[-1])
        cu_k_t = inputs.index("cu_seqlens_k", cu_k, p["strided_meta"], cu_k[-1])
        offsets = (torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32))
        # The kernels clamp max_seqlen to the packed totals (validate.check_varlen); so does the oracle.
        oracle_varlen = (*(t.to(inputs.device) for t in offsets), min(max_q, cu_q[-1]), min(max_k, cu_k[-1]))
    else:
        b, sq, sk = p["batch"], p["seqlen_q"], p["seqlen_k"]
        hnd = p["tensor_layout"] == "HND"
        shapes = {
            "q": (b, h, sq, d) if hnd else (b, sq, h, d),
            "k": (b, hk, sk, d) if hnd else (b, sk, hk, d),
            "v": (b, hk, sk, d) if hnd else (b, sk, hk, d),
        }
        kwargs.update(tensor_layout=p["tensor_layout"], return_lse=p["lse"])
    offset = {"k": p["k_offset"]}
    tensors = {n: inputs.tensor(n, shape, p[f"layout_{n}"], offset.get(n, 0.0)) for n, shape in shapes.items()}
    fn = getattr(flash_recipe.sage, p["api"])  # sageattn, sageattn_varlen and the path names

    def call():
        if varlen:
            return fn(tensors["q"], tensors["k"], tensors["v"], cu_q_t, cu_k_t, max_q, max_k, **kwargs)
        return fn(tensors["q"], tensors["k"], tensors["v"], **kwargs)

    # FP8 P.V runs on NVIDIA GPUs that have it; the CPU (the interpreter) always refuses it.
    on_gpu = inputs.device.type == "cuda"
    fp8_problem = int8_attention.fp8_problem(targets.target_of(inputs.device)) if on_gpu else "the CPU"
    wants_fp8 = p["pv_dtype"] == "fp8" or p["api"].startswith("sageattn_qk_int8_pv_fp8")
    refusal = ""
    if p["grad"]:
        for t in tensors.values():
            t.requires_grad_(True)
        refusal = "flash_attn_func"  # training goes to the differentiable kernels
    elif wants_fp8 and fp8_problem is not None:
        refusal = "pv_dtype='fp16'"  # the fix: 16-bit P.V
    if refusal:
        try:
            call()
        except NotImplementedError as exc:
            report.check(refusal in str(exc), f"refused with NotImplementedError naming {refusal}: {exc}")
        else:
            report.fail(f"ran, expected NotImplementedError naming {refusal}")
        return
    result = call()
    out, lse = result if p.get("lse") else (result, None)
    report.check(out.dtype == inputs.dtype, f"out dtype {out.dtype}")
    fp8 = wants_fp8 or p["pv_dtype"] == "omit" and p["api"] in ("sageattn", "sageattn_varlen") and fp8_problem is None
    config = int8_attention.plan_int8(inputs.device, d, fp8).config
    blocks = (config.block_m, config.block_n)
    q, k, v = (t.detach() for t in tensors.values())
    if not varlen and p["tensor_layout"] == "HND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    smooth = p["smooth_k"] is not False
    scale = d**-0.5 if p["scale"] is None else p["scale"]
    extra = oracle_varlen if varlen else ()
    truth, truth_lse = oracle.sage(q, k, v, scale, p["causal"], smooth, fp8, blocks, torch.float64, extra)
    same, same_lse = oracle.sage(q, k, v, scale, p["causal"], smooth, fp8, blocks, torch.float16, extra)
    if not varlen and p["tensor_layout"] == "HND":
        truth, same = truth.transpose(1, 2), same.transpose(1, 2)
    report.rule("out", out, truth, same.to(inputs.dtype), 2)
    if lse is not None:
        report.rule("lse", lse, truth_lse, same_lse, 2)


RUNNERS = {
    "dense": _run_dense,
    "qkvpacked": _run_dense,
    "kvpacked": _run_dense,
    "varlen": _run_varlen,
    "varlen_qkvpacked": _run_varlen,
    "varlen_kvpacked": _run_varlen,
    "paged": _run_paged,
    "kvcache": _run_kvcache,
    "sdpa": _run_sdpa,
    "sage": _run_sage,
    "sage_varlen": _run_sage,
}


# ----------------------------------------------------------------------------------------------
# pytest
# ----------------------------------------------------------------------------------------------


def pytest_generate_tests(metafunc):
    """``--fuzz-cases N`` (default DEFAULT_CASES) attention cases and N / EIGHT_BIT_SHARE 8-bit ones,
    of ``--fuzz-seed``; ``--fuzz-case I`` replays index I of each."""
    names = {"fuzz_case": draw_case, "fuzz_8bit_case": draw_8bit_case}
    name = next((n for n in names if n in metafunc.fixturenames), None)
    if name is None:
        return
    config = metafunc.config
    seed = config.getoption("--fuzz-seed")
    count = config.getoption("--fuzz-cases")
    count = DEFAULT_CASES if count is None else count
    if name == "fuzz_8bit_case":
        count = -(-count // EIGHT_BIT_SHARE)
    indices = config.getoption("--fuzz-case") or range(count)
    cases = [names[name](seed, i) for i in indices]
    metafunc.parametrize(name, cases, ids=[c.id for c in cases])


def test_fuzz(fuzz_case: Case, device, nan_outputs, bounds_checked, int_overflow_checked):
    """One drawn case (see the module docstring); under the interpreter, every kernel memory access is
    also checked to stay inside the launch's tensors (``bounds_checked``)."""
    _check(fuzz_case, device, bounds_checked)


def test_fuzz_8bit(fuzz_8bit_case: Case, device, nan_outputs, bounds_checked, int_overflow_checked):
    """One drawn 8-bit case, checked as ``test_fuzz`` checks its cases."""
    _check(fuzz_8bit_case, device, bounds_checked)


def _check(case: Case, device, bounds_checked) -> None:
    inputs, report = Inputs(case, device), Report()
    crash = ""
    path = case.params.get("path")
    try:
        with choose.taking_path(path) if path else contextlib.nullcontext():  # the backward runs at its grad
            RUNNERS[case.kind](case, inputs, report)
    except Exception as exc:  # noqa: BLE001 - any exception on a valid call is a finding
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-8:])
        crash = f"unexpected {type(exc).__name__}: {exc}\n{trace}"
    if bounds_checked is not None:  # reported here, with the replay line, rather than at teardown
        for violation in bounds_checked.take_violations():
            report.fail(f"memory: {violation}")
    if not crash:
        skip = ("k_cache", "v_cache") if case.kind == "kvcache" else ()
        changed = inputs.unchanged(skip)
        report.check(not changed, f"inputs unchanged (changed: {', '.join(changed) or 'none'})")
    if crash or report.problems:
        header = f"replay: {case.replay}\ncase {case.index} of seed {case.seed}: {case.describe()}"
        pytest.fail("\n".join([header, *report.lines, crash]).rstrip(), pytrace=False)
