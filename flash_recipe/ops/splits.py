"""The split-KV rule: how many shares of the keys a launch over a KV cache splits each row into.

A decoding step launches few programs (one per batch entry, launched head and query block) that
each stream a long cache. Split-KV gives every program ``splits`` programs, each streaming one
share of the key blocks, and merges their partial outputs (``split_merge.split_combine_kernel``, which
the forward launches after the shares).
``choose_splits`` picks the count from three numbers, so it is tested as a table on the CPU
(``tests/test_splits.py``); ``kvcache.heuristic_splits`` feeds it the launch's numbers and
``sm_count`` the GPU's (asked of torch). The module imports no Triton.

``python -m devtools.splits_report`` prints the choice for the campaign's decode grid.
"""

from __future__ import annotations

from typing import Any

import torch

from .limits import MAX_SPLITS

# Programs per multiprocessor that one wave holds. A decoding program streams keys with a single
# 16-row query tile: too little arithmetic to hide its own load latency, so it needs company on its
# multiprocessor (a second program whose loads are in flight while the first computes) to keep
# enough loads outstanding to approach the memory bandwidth.
PROGRAMS_PER_SM = 2
# A last wave at least this full counts as well filled (wave efficiency, ``wave_efficiency``).
GOOD_WAVE_EFFICIENCY = 0.85


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
    index = device if isinstance(device, int) else getattr(device, "index", None)
    if index is None:
        index = torch.cuda.current_device()
    found = _SM_COUNTS.get(index)
    if found is None:
        found = _SM_COUNTS[index] = int(torch.cuda.get_device_properties(index).multi_processor_count)
    return found


sm_count.cache_clear = _SM_COUNTS.clear  # type: ignore[attr-defined]
