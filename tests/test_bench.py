"""``flash-recipe bench`` and ``warmup`` on the CPU: the code paths CI can run."""

from __future__ import annotations

import csv
import io
import json
import statistics
import time

import pytest
import torch

import flash_recipe
from flash_recipe.tools import bench, cli


def test_flop_count_is_the_standard_one():
    shape = bench.Shape(2, 1024, 16, 16, 128, False, "float16")
    assert shape.flops("fwd") == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.Shape(2, 1024, 16, 16, 128, True, "float16").flops("fwd") == shape.flops("fwd") / 2
    assert shape.flops("bwd") == 2.5 * shape.flops("fwd")
    assert shape.flops("fwd_bwd") == 3.5 * shape.flops("fwd")


def test_bench_runs_on_cpu_and_writes_csv_and_markdown(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # bench the CPU fallback, not the interpreter
    csv_path, md_path = tmp_path / "b.csv", tmp_path / "b.md"
    status = cli.main(
        [
            "bench",
            "--seqlen",
            "64,128",
            "--head-dim",
            "32",
            "--dtype",
            "float32",
            "--nheads",
            "4",
            "--tokens",
            "256",
            "--warmup",
            "1",
            "--reps",
            "3",
            "--csv",
            str(csv_path),
            "--markdown",
            str(md_path),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    rows = list(csv.DictReader(io.StringIO(csv_path.read_text())))
    # 2 seqlens x causal/full x mha/gqa, for both CPU peers
    assert len(rows) == 8 * 2 and {r["peer"] for r in rows} == {"flash_recipe", "sdpa"}
    for row in rows:
        assert not row["error"]
        assert float(row["fwd_tflops"]) > 0 and float(row["bwd_tflops"]) > 0 and float(row["fwd_bwd_tflops"]) > 0
    assert "torch 2" in out.splitlines()[0] and "command: flash-recipe bench" in out.splitlines()[0]
    assert md_path.read_text().count("\n| B") == 16


def test_bench_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "b.png"
    status = cli.main(
        [
            "bench",
            "--seqlen",
            "64,128",
            "--head-dim",
            "32",
            "--dtype",
            "float32",
            "--causal",
            "no",
            "--gqa",
            "no",
            "--nheads",
            "2",
            "--tokens",
            "128",
            "--mode",
            "fwd",
            "--reps",
            "2",
            "--plot",
            str(path),
        ]
    )
    assert status == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_peer(capsys):
    assert cli.main(["bench", "--peer", "cudnn", "--seqlen", "64", "--head-dim", "32", "--dtype", "float32"]) == 2
    assert "peer must be one of" in capsys.readouterr().err


@pytest.fixture
def one_thread():
    """One intra-op thread: no thread-pool scheduling noise on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.serial
def test_dispatch_overhead_on_cpu_is_within_5_percent(monkeypatch, one_thread):
    """flash_attn_func on the CPU costs at most 1.05x a direct SDPA call (B1, S512, H8, D64, causal).

    Calls are interleaved in rounds and the fastest round of each is compared: interference from
    other processes only ever adds time, so the minimum is the stable estimate.
    """
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 512, 8, 64)
    qt = q.transpose(1, 2)

    def ours():
        flash_recipe.flash_attn_func(q, q, q, causal=True)

    def direct():
        torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True)

    rounds = {ours: [], direct: []}
    for fn in rounds:
        for _ in range(10):
            fn()
    for _ in range(25):
        for fn, times in rounds.items():
            begin = time.perf_counter()
            for _ in range(10):
                fn()
            times.append(time.perf_counter() - begin)
    ratio = min(rounds[ours]) / min(rounds[direct])
    assert ratio <= 1.05, (
        f"ratio {ratio:.3f} (medians {statistics.median(rounds[ours]):.5f} vs "
        f"{statistics.median(rounds[direct]):.5f} s per 10 calls)"
    )


def test_warmup_without_gpu_says_why(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cli.main(["warmup"]) == 2
    assert "no CUDA or ROCm GPU" in capsys.readouterr().err


def test_bench_json_is_rewritten_after_every_row(tmp_path, capsys, monkeypatch):
    """``--json`` holds every row measured so far, so an interrupted run keeps them; nheads 2 with
    GQA has one kv head."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tmp_path / "b.json"
    seen = []
    real_run_bench = bench.run_bench

    def spy(args, progress=print, on_row=None):
        def record(rows):
            on_row(rows)
            seen.append(len(json.loads(path.read_text())["rows"]))

        return real_run_bench(args, progress, record)

    monkeypatch.setattr(bench, "run_bench", spy)
    args = ["--seqlen", "32", "--head-dim", "16", "--dtype", "float32", "--nheads", "2", "--tokens", "64"]
    args += ["--gqa", "yes", "--causal", "no", "--reps", "2", "--warmup", "1", "--json", str(path)]
    assert cli.main(["bench", *args]) == 0
    document = json.loads(path.read_text())
    assert seen == [1, 2] and document["complete"] and len(document["rows"]) == 2
    assert document["context"].startswith("device cpu") and document["modes"] == list(bench.MODES)
    assert [row["shape"] for row in document["rows"]] == ["B2-S32-H2-gqa2-D16-full-float32"] * 2
    assert all(row["fwd_tflops"] > 0 for row in document["rows"])
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]


def test_peak_memory_needs_cuda_and_a_known_mode():
    shape = bench.Shape(1, 64, 2, 2, 16, False, "float32")
    with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'"):
        bench.peak_memory(bench.peers("cpu")["sdpa"], shape, torch.device("cpu"), "fwd")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="mode must be one of"):
            bench.peak_memory(bench.peers("cuda")["sdpa_math"], shape, torch.device("cuda"), "bwd")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_peak_memory_of_the_kernels_is_linear_in_the_sequence_length():
    """A training step of the Triton kernels allocates its output and gradients, never an S x S
    matrix: from 4k to 8k tokens its peak grows at most 1.1 x 2, and it is at least the output
    (forward) or the output and three gradients (forward and backward)."""
    device = torch.device("cuda")
    peer = bench.peers("cuda")["flash_recipe"]
    for mode, tensors in (("fwd", 1), ("fwd_bwd", 4)):
        peaks = []
        for seqlen in (4096, 8192):
            shape = bench.Shape(1, seqlen, 8, 8, 128, True, "bfloat16")
            result = bench.peak_memory(peer, shape, device, mode)
            q_mb = seqlen * 8 * 128 * 2 / 2**20
            assert result["before_mb"] >= 4 * q_mb  # q, k, v, dout
            assert result["peak_mb"] >= tensors * q_mb, result
            assert result["total_mb"] == pytest.approx(result["before_mb"] + result["peak_mb"])
            peaks.append(result["peak_mb"])
        assert peaks[1] <= 2.2 * peaks[0], (mode, peaks)
