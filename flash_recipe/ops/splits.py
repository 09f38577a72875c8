"""The split-KV rule: how many shares of the keys a launch over a KV cache splits each row into.

A decoding step launches few programs (one per batch entry, launched head and query block) that
each stream a long cache. Split-KV gives every program ``splits`` programs, each streaming one
share of the key blocks, and merges their partial outputs (``split_combine_kernel``, here: the
kernel the forward launches after the shares).
``choose_splits`` picks the count from three numbers, so it is tested as a table on the CPU
(``tests/test_splits.py``); ``kvcache.heuristic_splits`` feeds it the launch's numbers and
``sm_count`` the GPU's.

``python -m flash_recipe.ops.splits`` prints the choice for the campaign's decode grid
(``split_table``) as a markdown table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import triton
import triton.language as tl

from flash_recipe.ops import configs
from flash_recipe.ops.tiles import load_tile, loop_bound, sequence, store_tile

# Programs per multiprocessor that one wave holds. A decoding program streams keys with a single
# 16-row query tile: too little arithmetic to hide its own load latency, so it needs company on its
# multiprocessor (a second program whose loads are in flight while the first computes) to keep
# enough loads outstanding to approach the memory bandwidth.
PROGRAMS_PER_SM = 2
# A last wave at least this full counts as well filled (wave efficiency, ``wave_efficiency``).
GOOD_WAVE_EFFICIENCY = 0.85
# The most splits the rule chooses: flash-attn's cap, which ``flash_recipe.decoding.MAX_SPLITS``
# (the most ``num_splits`` a caller may ask for) and ``tuned.MAX_SPLITS`` (the most a tuned file may
# hold) repeat; tests/test_splits.py keeps the three equal.
MAX_SPLITS = 128


def _count(name: str, value: Any, minimum: int) -> int:
    """``value``, checked to be an int (not a bool) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def wave_efficiency(programs: int, splits: int, sms: int) -> float:
    """How full the waves of ``programs * splits`` programs are on ``sms`` multiprocessors.

    A wave is ``sms * PROGRAMS_PER_SM`` programs. With ``waves = programs * splits / wave`` the
    efficiency is ``waves / ceil(waves)``: 1.0 when the last wave is full, 0.51 when 1.02 waves
    leave a second wave almost empty (it takes as long as a full one).
    """
    launched = programs * splits
    wave = sms * PROGRAMS_PER_SM
    return launched / (wave * -(-launched // wave)) if launched else 0.0


def critical_path(programs: int, splits: int, key_blocks: int, sms: int) -> int:
    """Key blocks the busiest multiprocessor slot streams: ``ceil(programs * splits / (sms *
    PROGRAMS_PER_SM))`` waves of ``ceil(key_blocks / splits)`` blocks each (the merge of the
    partials is not counted). A proxy for a split-KV launch's time that the tests compare choices by."""
    waves = -(-programs * splits // (sms * PROGRAMS_PER_SM))
    return waves * -(-key_blocks // splits)


def choose_splits(programs: int, key_blocks: int, sms: int) -> int:
    """The split-KV count of a launch.

    The rule: a launch should give the GPU at least one full wave of ``sms * PROGRAMS_PER_SM``
    programs. When the ``programs`` of one split (batch x heads as launched x query blocks; with
    GQA packing the heads are the kv heads) already make a wave, the count is 1. Otherwise it is the
    smallest count that reaches a wave and leaves the last wave well filled (``wave_efficiency`` at
    least ``GOOD_WAVE_EFFICIENCY``); when no count in range does, the one with the best efficiency
    (the smallest of equals). Counts range up to ``key_blocks`` (each split owns at least one key
    block of the launch's ``BLOCK_N``) and ``MAX_SPLITS``; a cache too short to reach a wave gets as
    many splits as it has key blocks, the most it can take.

    Args:
        programs: programs one split launches, >= 0 (0: nothing to fill, 1 split).
        key_blocks: ``cdiv(cache capacity, BLOCK_N)``, >= 0.
        sms: the GPU's multiprocessors (``sm_count``), >= 1.

    Returns:
        The count, from 1 to ``min(max(key_blocks, 1), MAX_SPLITS)``.
    """
    _count("programs", programs, 0)
    _count("key_blocks", key_blocks, 0)
    _count("sms", sms, 1)
    wave = sms * PROGRAMS_PER_SM
    if programs == 0 or programs >= wave:
        return 1
    most = max(1, min(key_blocks, MAX_SPLITS))
    fewest = -(-wave // programs)  # the smallest count that reaches one wave
    if fewest >= most:
        return most  # the cache is too short to split further
    best, best_launched, best_slots = fewest, 0, 1
    for splits in range(fewest, most + 1):
        launched = programs * splits
        slots = wave * -(-launched // wave)  # efficiency = launched / slots, compared exactly
        if launched * 100 >= round(GOOD_WAVE_EFFICIENCY * 100) * slots:
            return splits
        if launched * best_slots > best_launched * slots:
            best, best_launched, best_slots = splits, launched, slots
    return best


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: Any) -> int:
    """The multiprocessors of CUDA (or ROCm) ``device`` (a ``torch.device``, an index, or None for
    the current one), asked of torch once per device index.

    The memo is a plain dict, not ``functools.lru_cache``: torch.compile traces into an lru_cache
    wrapper (``dispatch.capabilities.computed_once`` says more). ``sm_count.cache_clear()``
    forgets the answers (tests that fake a GPU call it).
    """
    import torch

    index = device if isinstance(device, int) else getattr(device, "index", None)
    if index is None:
        index = torch.cuda.current_device()
    found = _SM_COUNTS.get(index)
    if found is None:
        found = _SM_COUNTS[index] = int(torch.cuda.get_device_properties(index).multi_processor_count)
    return found


sm_count.cache_clear = _SM_COUNTS.clear  # type: ignore[attr-defined]


# -- the table --------------------------------------------------------------------------------------

# The campaign's decode grid (``flash_recipe.tools.campaign.plan``: DECODE_BATCHES, DECODE_CACHES;
# tests/test_splits.py keeps them equal) and its shape, Llama-3-8B: 32 query heads over 8 kv heads
# of head dim 128, bf16, one query row per step.
TABLE_BATCHES = (1, 8, 32, 64)
TABLE_CACHES = (1024, 8192, 32768)
TABLE_SHAPE = {"nheads": 32, "nheads_k": 8, "head_dim": 128, "element_size": 2}
# GPUs by multiprocessor count and compile target: A100 (sm80), H100/H200 (sm90), RTX 4090 (sm89).
TABLE_GPUS = ((108, "sm80"), (132, "sm90"), (128, "sm89"))


class SplitRow(NamedTuple):
    """One row of ``split_table``: a decoding step of ``batch`` over a cache of ``cache`` rows on a
    GPU of ``sms`` multiprocessors, packed (one program per kv head) and unpacked (per query head).
    ``waves``: ``programs * splits / (sms * PROGRAMS_PER_SM)``; ``path``: ``critical_path``."""

    batch: int
    cache: int
    sms: int
    target: str
    block_n: int
    key_blocks: int
    programs: int
    splits: int
    waves: float
    efficiency: float
    path: int
    unpacked_programs: int
    unpacked_splits: int
    unpacked_path: int


def split_table(
    batches: Iterable[int] = TABLE_BATCHES,
    caches: Iterable[int] = TABLE_CACHES,
    gpus: Sequence[tuple[int, str]] = TABLE_GPUS,
    nheads: int = TABLE_SHAPE["nheads"],
    nheads_k: int = TABLE_SHAPE["nheads_k"],
    head_dim: int = TABLE_SHAPE["head_dim"],
    element_size: int = TABLE_SHAPE["element_size"],
) -> list[SplitRow]:
    """The choice for a one-row decoding step of each ``batch x cache`` on each ``(sms, target)``
    GPU, with the key blocks of that target's decode ``BLOCK_N`` (``configs.get_config``). The GQA
    group is packed into one 16-row query tile per kv head, as ``forward.gqa_packing`` packs it."""
    rows = []
    for sms, target in gpus:
        block_n = configs.get_config(target, "decode", head_dim, element_size).block_n
        for batch in batches:
            for cache in caches:
                key_blocks = -(-cache // block_n)
                packed, unpacked = batch * nheads_k, batch * nheads
                splits = choose_splits(packed, key_blocks, sms)
                unpacked_splits = choose_splits(unpacked, key_blocks, sms)
                rows.append(SplitRow(
                    batch, cache, sms, target, block_n, key_blocks, packed, splits,
                    packed * splits / (sms * PROGRAMS_PER_SM), wave_efficiency(packed, splits, sms),
                    critical_path(packed, splits, key_blocks, sms), unpacked, unpacked_splits,
                    critical_path(unpacked, unpacked_splits, key_blocks, sms),
                ))
    return rows


def markdown(rows: Iterable[SplitRow]) -> str:
    """``split_table``'s rows as a markdown table."""
    lines = [
        "| SMs | batch | cache | key blocks | programs | splits | waves | efficiency | path "
        "| unpacked programs | unpacked splits | unpacked path |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.sms} ({r.target}) | {r.batch} | {r.cache} | {r.key_blocks} | {r.programs} | {r.splits} "
            f"| {r.waves:.2f} | {r.efficiency:.2f} | {r.path} | {r.unpacked_programs} | {r.unpacked_splits} "
            f"| {r.unpacked_path} |"
        )
    return "\n".join(lines)


@triton.heuristics({"IS_VARLEN": lambda a: a["CU_Q"] is not None, "MASK_D": lambda a: a["head_dim"] != a["BLOCK_D"]})
@triton.jit
def split_combine_kernel(
    O_SPLIT, LSE_SPLIT, O, LSE, CU_Q,
    stride_ps, stride_pb, stride_pm, stride_ph, stride_qs, stride_lb, stride_lh,
    stride_ob, stride_om, stride_oh, seqlen_q, total_q, head_dim, num_splits,
    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
):
    """Merge the split-KV partials of ``attn_fwd_kernel``. Grid ``(cdiv(max Sq, BLOCK_M), H, B)``.

    ``O_SPLIT (num_splits, *out.shape)`` float32 holds each share's normalised output and
    ``LSE_SPLIT (num_splits, *lse.shape)`` its log-sum-exp (+inf: the share saw no key). With
    ``M = max_s lse_s`` and ``w_s = exp(lse_s - M)``: ``out = sum_s w_s o_s / sum_s w_s`` and
    ``lse = M + log(sum_s w_s)``; a row no share saw gets out 0 and lse +inf, as unsplit.
    """
    i_m = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2)
    bos_q, seqlen_q = sequence(CU_Q, i_b, seqlen_q, total_q, IS_VARLEN)
    i_b = i_b.to(tl.int64)
    o_r = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_m = i_m * BLOCK_M + o_r
    m_rows = o_m < seqlen_q
    p_lse = LSE_SPLIT + i_b * stride_lb + i_h * stride_lh + bos_q + o_m  # [BLOCK_M]
    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for i_s in range(0, loop_bound(num_splits)):
        b_lse = tl.load(p_lse + i_s * stride_qs, mask=m_rows, other=float("inf"))
        b_max = tl.maximum(b_max, tl.where(b_lse == float("inf"), float("-inf"), b_lse))
    b_ref = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    o_base = O_SPLIT + i_b * stride_pb + bos_q * stride_pm + i_h * stride_ph
    for i_s in range(0, loop_bound(num_splits)):
        b_lse = tl.load(p_lse + i_s * stride_qs, mask=m_rows, other=float("inf"))
        b_w = tl.where(b_lse == float("inf"), 0.0, tl.exp(b_lse - b_ref))  # [BLOCK_M]
        b_o = load_tile(o_base + i_s * stride_ps, i_m * BLOCK_M, stride_pm, seqlen_q, head_dim, o_r, o_d, True, MASK_D)
        b_acc += b_w[:, None] * b_o
        b_sum += b_w
    m_empty = b_sum == 0.0
    b_sum_safe = tl.where(m_empty, 1.0, b_sum)
    b_out = b_acc / b_sum_safe[:, None]
    b_lse_out = tl.where(m_empty, float("inf"), b_ref + tl.log(b_sum_safe))
    store_tile(O + i_b * stride_ob + bos_q * stride_om + i_h * stride_oh, i_m * BLOCK_M, stride_om, seqlen_q, head_dim,
               o_r, o_d, b_out, True, MASK_D)
    tl.store(LSE + i_b * stride_lb + i_h * stride_lh + bos_q + o_m, b_lse_out, mask=m_rows)


if __name__ == "__main__":
    shape = TABLE_SHAPE
    print(
        f"Split-KV counts for one decoding step, H={shape['nheads']} Hk={shape['nheads_k']} "
        f"D={shape['head_dim']} bf16, {PROGRAMS_PER_SM} programs per SM a wave, "
        "path: the critical path in key blocks per slot (critical_path)\n"
    )
    print(markdown(split_table()))
