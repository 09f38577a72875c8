"""``flash_recipe.tools.bench_decode``: its table and its peers (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from flash_recipe.tools import bench_decode


def _result():
    context = {
        "device": "NVIDIA H100 80GB HBM3",
        "date": "2026-11-25",
        "torch": "2.11",
        "triton": "3.6",
        "peak_bytes_per_s": bench_decode.peak_bandwidth("NVIDIA H100 80GB HBM3"),
        "copy_bytes_per_s": 3e12,
        "nheads": 32,
        "nheads_k": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
        "command": "bench_decode",
    }
    rows = [
        {"batch": 8, "cache": 8192, "peer": "flash_recipe", "bytes_per_s": 6.7e11, "graph_bytes_per_s": 2.68e12},
        {"batch": 8, "cache": 8192, "peer": "sdpa", "bytes_per_s": 1.34e12, "graph_bytes_per_s": 1.34e12},
        {"batch": 8, "cache": 32768, "peer": "flash_recipe", "error": "RuntimeError: no"},
        {"batch": 8, "cache": 32768, "peer": "sdpa", "bytes_per_s": 1e12},
    ]  # fmt: skip
    return {"context": context, "rows": rows}


def test_the_table_gives_bandwidth_share_of_peak_and_ratio_per_timing():
    called = bench_decode.markdown(_result())
    assert "| 8 | 8192 | 670 (20%) | 1340 (40%) | 0.50x |" in called
    assert "| 8 | 32768 | n/a | 1000 (30%) | n/a |" in called  # a failed peer is n/a, not dropped
    graphed = bench_decode.markdown(_result(), "graph_bytes_per_s")
    assert "replayed from a CUDA graph" in graphed and "| 8 | 8192 | 2680 (80%) | 1340 (40%) | 2.00x |" in graphed


def test_peak_bandwidth_by_model_and_unknown_peers_are_refused():
    assert bench_decode.peak_bandwidth("NVIDIA H200") == 4.8e12 and bench_decode.peak_bandwidth("Tesla T4") is None
    with pytest.raises(ValueError, match="peer must be one of flash_recipe, flash_recipe_unpacked, sdpa"):
        bench_decode._step("flex", None, None, None, None)
