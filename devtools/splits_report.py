"""What the split-KV rule (``flash_recipe.ops.splits.choose_splits``) chooses for the campaign's
decode grid, as a markdown table::

    python -m devtools.splits_report

One row per GPU (A100, H100/H200, RTX 4090 by multiprocessor count and compile target), batch and
cache length of a one-row decoding step of Llama-3-8B's shape (32 query heads over 8 kv heads,
head dim 128, bf16): the key blocks of the target's decode ``BLOCK_N``, the programs of one split
and the splits chosen, packed (one program per kv head) and unpacked (one per query head), with
the waves they make, the last wave's efficiency and the critical path (``critical_path``: key
blocks the busiest multiprocessor slot streams, a proxy for the launch's time).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from flash_recipe.ops import configs, targets
from flash_recipe.ops.splits import PROGRAMS_PER_SM, choose_splits, wave_efficiency

# The campaign's decode grid (``devtools.campaign.plan``: DECODE_BATCHES, DECODE_CACHES;
# tests/test_splits.py keeps them equal) and its shape, Llama-3-8B: 32 query heads over 8 kv heads
# of head dim 128, bf16, one query row per step.
TABLE_BATCHES = (1, 8, 32, 64)
TABLE_CACHES = (1024, 8192, 32768)
TABLE_SHAPE = {"nheads": 32, "nheads_k": 8, "head_dim": 128, "element_size": 2}
# GPUs by multiprocessor count and compile target: A100 (sm80), H100/H200 (sm90), RTX 4090 (sm89).
TABLE_GPUS = targets.OFFLINE_GPUS


def critical_path(programs: int, splits: int, key_blocks: int, sms: int) -> int:
    """Key blocks the busiest multiprocessor slot streams: ``ceil(programs * splits / (sms *
    PROGRAMS_PER_SM))`` waves of ``ceil(key_blocks / splits)`` blocks each (the merge of the
    partials is not counted). A proxy for a split-KV launch's time that the tests compare choices by."""
    waves = -(-programs * splits // (sms * PROGRAMS_PER_SM))
    return waves * -(-key_blocks // splits)


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
    group is packed into one 16-row query tile per kv head, as ``packing.gqa_packing`` packs it."""
    rows = []
    for sms, target in gpus:
        block_n = configs.get_config(target, "decode", head_dim, element_size).block_n
        for batch in batches:
            for cache in caches:
                key_blocks = -(-cache // block_n)
                packed, unpacked = batch * nheads_k, batch * nheads
                splits = choose_splits(packed, key_blocks, sms)
                unpacked_splits = choose_splits(unpacked, key_blocks, sms)
                rows.append(
                    SplitRow(
                        batch,
                        cache,
                        sms,
                        target,
                        block_n,
                        key_blocks,
                        packed,
                        splits,
                        packed * splits / (sms * PROGRAMS_PER_SM),
                        wave_efficiency(packed, splits, sms),
                        critical_path(packed, splits, key_blocks, sms),
                        unpacked,
                        unpacked_splits,
                        critical_path(unpacked, unpacked_splits, key_blocks, sms),
                    )
                )
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


def main() -> None:
    shape = TABLE_SHAPE
    print(
        f"Split-KV counts for one decoding step, H={shape['nheads']} Hk={shape['nheads_k']} "
        f"D={shape['head_dim']} bf16, {PROGRAMS_PER_SM} programs per SM a wave, "
        "path: the critical path in key blocks per slot (critical_path)\n"
    )
    print(markdown(split_table()))


if __name__ == "__main__":
    main()
