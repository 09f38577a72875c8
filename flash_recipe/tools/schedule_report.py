"""What a model of a launch says of the order the forward and the dQ kernel start their programs in
(``flash_recipe.ops.schedule``), for the campaign's causal shapes, as a markdown table::

    python -m flash_recipe.tools.schedule_report

A model, not a timing (``model_time``): programs dispatched greedily to 132 slots (one 128 x 128
program per multiprocessor of an H100), each costing one unit plus one per key block it visits, no
memory effects. Per causal shape (bf16, head dim 128, 50 MiB of L2) it prints the programs, the
heads per section (``schedule.section_heads``) and the modelled time of the plain order and of
``schedule.launch_sequence``, each over the ideal ``total work / slots``.
"""

from __future__ import annotations

import heapq

from ..ops.schedule import launch_sequence, section_heads

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


def model_rows(shapes=MODEL_SHAPES, slots: int = MODEL_SLOTS, l2: int = MODEL_L2_BYTES, block: int = 128) -> list:
    """``(batch, seqlen, heads, programs, section, plain, ordered)`` per causal shape: the modelled
    time of the plain order and of ``launch_sequence``, over the ideal ``total work / slots``. A
    program costs 1 plus the key blocks it visits (block ``m`` sees ``m + 1``)."""
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
            )
        )
    return rows


def main() -> None:
    print(f"A model, not a timing: {MODEL_SLOTS} slots, {MODEL_L2_BYTES >> 20} MiB of L2, causal, bf16, head dim 128;")
    print("each launch's modelled time over the ideal (total work / slots)\n")
    print("| causal shape | programs | section | plain order | this order |\n|---|---:|---:|---:|---:|")
    for batch, seqlen, heads, programs, section, plain, ordered in model_rows():
        print(f"| B{batch} S{seqlen} H{heads} | {programs} | {section} | {plain:.3f} | {ordered:.3f} |")


if __name__ == "__main__":
    main()
