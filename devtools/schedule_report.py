"""What a model of a launch says of the order the forward and the dQ kernel start their programs in
(``flash_recipe.ops.schedule``), for the campaign's causal shapes, as a markdown table::

    python -m devtools.schedule_report

A model, not a timing (``model_time``): programs dispatched greedily to 132 slots (one 128 x 128
program per multiprocessor of an H100), each costing one unit plus one per key block it visits, no
memory effects. Per causal shape (bf16, head dim 128, 50 MiB of L2) it prints the programs, the
heads per section (``schedule.section_heads``) and the modelled time of the plain order and of
``schedule.launch_sequence``, each over the ideal ``total work / slots``, and that of a persistent
grid: one program per slot striding over the same sequence (``persistent_time``), or dealt the
units heaviest first (``balanced_persistent_time``).
"""

from __future__ import annotations

import heapq

from flash_recipe.ops.schedule import launch_sequence, section_heads

# The model's launches: the campaign's causal bench shapes (16k tokens, 16 heads) and one with 8
# heads; bf16 at head dim 128 in 128 x 128 blocks, one program per multiprocessor of an H100.
MODEL_SHAPES = ((8, 2048, 16), (4, 4096, 16), (2, 8192, 16), (1, 16384, 16), (2, 8192, 8))
MODEL_SLOTS = 132
MODEL_L2_BYTES = 50 * 2**20


def model_time(costs: list[float], slots: int) -> float:
    """When the last of ``costs`` (each program's time, in launch order) ends if each starts on the
    first of ``slots`` to free up: a model of a GPU's dispatch, without memory or clock effects."""
    ends = [0.0] * slots
    for cost in costs:
        heapq.heappush(ends, heapq.heappop(ends) + cost)
    return max(ends)


def persistent_time(costs: list[float], slots: int) -> float:
    """When the last of ``costs`` (in launch order) ends on a persistent grid of ``slots`` programs,
    program ``p`` running units ``p, p + slots, ...`` one after another (a grid-stride loop): the
    assignment is fixed before any unit runs, where a GPU's dispatch gives each unit to the first
    free slot (``model_time``). The fixed cost each unit carries (its queries' load, its output's
    store) stays: only overlapping it with the next unit's loop, which takes warp specialisation,
    would remove it, and the model has no overlap."""
    return max(sum(costs[first::slots]) for first in range(min(slots, len(costs))))


def balanced_persistent_time(costs: list[float], slots: int) -> float:
    """``persistent_time`` with the units dealt out heaviest first, back and forth across the
    programs (program 0 to the last, then the last to 0, ...): a good fixed assignment, at the price
    of the sections' L2 locality."""
    loads = [0.0] * slots
    for index, cost in enumerate(sorted(costs, reverse=True)):
        turn, place = divmod(index, slots)
        loads[place if turn % 2 == 0 else slots - 1 - place] += cost
    return max(loads)


def model_rows(shapes=MODEL_SHAPES, slots: int = MODEL_SLOTS, l2: int = MODEL_L2_BYTES, block: int = 128) -> list:
    """``(batch, seqlen, heads, programs, section, plain, ordered, persistent, balanced)`` per causal
    shape: the modelled time of the plain order, of ``launch_sequence`` and of a persistent grid
    over that sequence (``persistent_time``, ``balanced_persistent_time``), over the ideal ``total
    work / slots``. A program costs 1 plus the key blocks it visits (block ``m`` sees ``m + 1``)."""
    rows = []
    for batch, seqlen, heads in shapes:
        blocks, count = -(-seqlen // block), batch * heads
        section = section_heads(count, blocks, 2 * seqlen * 128 * 2, l2, True)
        plain = [1.0 + m + 1 for _ in range(count) for m in range(blocks)]
        ordered = [1.0 + m + 1 for m, _ in launch_sequence(blocks, count, section)]
        ideal = sum(plain) / slots
        rows.append(
            (
                batch,
                seqlen,
                heads,
                len(plain),
                section,
                model_time(plain, slots) / ideal,
                model_time(ordered, slots) / ideal,
                persistent_time(ordered, slots) / ideal,
                balanced_persistent_time(ordered, slots) / ideal,
            )
        )
    return rows


def main() -> None:
    print(f"A model, not a timing: {MODEL_SLOTS} slots, {MODEL_L2_BYTES >> 20} MiB of L2, causal, bf16, head dim 128;")
    print("each launch's modelled time over the ideal (total work / slots)\n")
    print(
        "| causal shape | programs | section | plain order | this order | persistent, grid-stride | persistent, "
        "balanced |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for batch, seqlen, heads, programs, section, *times in model_rows():
        cells = " | ".join(f"{t:.3f}" for t in times)
        print(f"| B{batch} S{seqlen} H{heads} | {programs} | {section} | {cells} |")


if __name__ == "__main__":
    main()
