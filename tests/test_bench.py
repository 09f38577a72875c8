"""``flash-recipe bench`` and ``warmup`` on the CPU: the code paths CI can run."""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import time

import pytest
import torch

import flash_recipe
from flash_recipe.tools import bench, bench_timing, cli


def test_flop_count_is_the_standard_one():
    shape = bench.Shape(2, 1024, 1024, 16, 16, 128, False, "float16")
    assert shape.flops("fwd") == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.Shape(2, 1024, 1024, 16, 16, 128, True, "float16").flops("fwd") == shape.flops("fwd") / 2
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
        assert all(float(row[f"{mode}_host_us"]) > 0 for mode in bench.MODES)
    assert "torch 2" in out.splitlines()[0] and "command: flash-recipe bench" in out.splitlines()[0]
    assert md_path.read_text().count("\n| B") == 16
    assert "| fwd host us | bwd host us | fwd_bwd host us | peak MB | failed |" in md_path.read_text()


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

    Each call is timed beside a direct one, in alternating order, and the median of the 200 ratios
    is compared: a slow moment of the machine slows both calls of a pair, and the median ignores
    the pairs one interruption hit. (The fastest of 25 rounds of each, compared before, moved by
    several percent from run to run on a 2-core machine, across the bound.)
    """
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 512, 8, 64)
    qt = q.transpose(1, 2)

    def ours():
        flash_recipe.flash_attn_func(q, q, q, causal=True)

    def direct():
        torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True)

    def timed(fn) -> float:
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    for _ in range(10):
        ours()
        direct()
    ratios = []
    for i in range(200):
        if i % 2:
            mine, theirs = timed(ours), timed(direct)
        else:
            theirs, mine = timed(direct), timed(ours)
        ratios.append(mine / theirs)
    ratio = statistics.median(ratios)
    quartiles = [round(x, 3) for x in statistics.quantiles(ratios)]
    assert ratio <= 1.05, f"median ratio {ratio:.3f} over {len(ratios)} pairs (quartiles {quartiles})"


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
    shape = bench.Shape(1, 64, 64, 2, 2, 16, False, "float32")
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
            shape = bench.Shape(1, seqlen, seqlen, 8, 8, 128, True, "bfloat16")
            result = bench.peak_memory(peer, shape, device, mode)
            q_mb = seqlen * 8 * 128 * 2 / 2**20
            assert result["before_mb"] >= 4 * q_mb  # q, k, v, dout
            assert result["peak_mb"] >= tensors * q_mb, result
            assert result["total_mb"] == pytest.approx(result["before_mb"] + result["peak_mb"])
            peaks.append(result["peak_mb"])
        assert peaks[1] <= 2.2 * peaks[0], (mode, peaks)


# ----------------------------------------------------------------------------- timing and verdicts


class _Recorder:
    """A stand-in for ``bench_timing.CudaClock``: logs what the timer does, and gives each repetition's
    event pair the elapsed milliseconds it is scripted to."""

    def __init__(self, log: list, elapsed_ms: list):
        self.log, self.elapsed_ms, self.events = log, list(elapsed_ms), 0

    def event(self):
        recorder, index = self, self.events
        self.events += 1

        class Event:
            def record(self):
                recorder.log.append(f"record {index}")

            def elapsed_time(self, end):
                return recorder.elapsed_ms[index // 2]

        return Event()

    def flush(self):
        self.log.append("flush")

    def synchronize(self):
        self.log.append("sync")

    def mark(self):
        self.log.append("mark")

    def peak(self):
        return 123


def _scripted_now(host_seconds: list):
    """A clock whose consecutive (begin, end) readings are ``host_seconds`` apart."""
    readings = []
    for t, seconds in enumerate(host_seconds):
        readings += [10.0 * t, 10.0 * t + seconds]
    return iter(readings).__next__


def test_timer_issues_the_repetitions_back_to_back_and_synchronises_once():
    """Like do_bench: L2 flushed before each repetition outside its event pair, ``setup`` outside
    too, each call between its own pair of events, one synchronisation after the last; the
    median of the per-repetition times and of the host time around each call."""
    log: list = []
    clock = _Recorder(log, elapsed_ms=[5.0, 1.0, 3.0])
    timer = bench_timing.Timer("cuda", 2, 3, clock=clock, now=_scripted_now([1e-3, 3e-3, 2e-3]), probe=dict)
    timing = timer(lambda: log.append("call"), setup=lambda: log.append("setup"))
    warmup = ["setup", "call"] * 2
    reps = [["setup", "flush", f"record {2 * i}", "call", f"record {2 * i + 1}"] for i in range(3)]
    assert log == warmup + ["sync", "mark"] + [step for rep in reps for step in rep] + ["sync"]
    assert timing.ms == 3.0 and timing.host_us == pytest.approx(2000.0)
    assert timing.peak_bytes == 123 and timing.compiled == {}


def test_timer_on_the_cpu_reads_the_wall_clock():
    timer = bench_timing.Timer("cpu", 0, 3, now=_scripted_now([4e-3, 1e-3, 2e-3]), probe=dict)
    timing = timer(lambda: None)
    assert timer.clock is None and timing.ms == pytest.approx(2.0) and timing.host_us == pytest.approx(2000.0)
    assert timing.peak_bytes is None


@pytest.mark.parametrize("warmup, reps, argument", [(1, 0, "reps"), (-1, 3, "warmup")])
def test_timer_rejects_counts_it_cannot_take_a_median_of(warmup, reps, argument):
    with pytest.raises(ValueError, match=f"--{argument} must be at least"):
        bench_timing.Timer("cpu", warmup, reps)


@pytest.mark.parametrize("seqlen", [512, 4096, 8192, 16384])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_memory_bound_parts_fused_kernels_from_materialised_scores(seqlen, head_dim):
    """The bound itself is the edge: at it a row passes, a byte above it fails. The scores and
    their softmax, two half-precision S x S matrices, always exceed it from S = 4096; sixteen
    half-precision tensors the size of q (what a fused kernel is allowed) never do."""
    shape = bench.Shape(max(1, 16384 // seqlen), seqlen, seqlen, 16, 4, head_dim, True, "bfloat16")
    bound = bench_timing.memory_bound(shape)
    assert bench_timing.memory_verdict(int(bound), shape) is None
    error = bench_timing.memory_verdict(int(bound) + 1, shape)
    assert error is not None and "suggests S^2 scores were materialised (fell back to an unfused path)" in error
    q_bytes = shape.batch * seqlen * shape.nheads * head_dim * 2
    assert bench_timing.memory_verdict(16 * q_bytes, shape) is None
    if seqlen >= 4096:
        assert bench_timing.memory_verdict(2 * bench_timing.scores_bytes(shape), shape) is not None
    assert bench_timing.memory_verdict(None, shape) is None  # no CUDA, no verdict


def test_judge_keeps_no_figure_for_a_failed_mode():
    shape = bench.Shape(1, 4096, 4096, 16, 16, 128, True, "bfloat16")
    fine = bench_timing.Timing(2.0, 40.0, 64 * 2**20, {})
    heavy = bench_timing.Timing(1.0, 40.0, int(2 * bench_timing.scores_bytes(shape)), {})
    recompiled = bench_timing.Timing(1.0, 40.0, 64 * 2**20, {"frames compiled": 1, "graphs": 1})
    row = bench_timing.judge(shape, {"fwd": fine, "bwd": heavy, "fwd_bwd": recompiled}, {"frames compiled": 2})
    assert row["fwd_tflops"] == pytest.approx(shape.flops("fwd") / 2e-3 / 1e12) and row["fwd_host_us"] == 40.0
    assert not any(key in row for key in ("bwd_ms", "bwd_tflops", "bwd_host_us", "fwd_bwd_tflops", "fwd_bwd_ms"))
    assert row["bwd_peak_mb"] == row["peak_mb"] == 2 * bench_timing.scores_bytes(shape) / 2**20
    assert row["error"] == (
        f"bwd: {bench_timing.memory_verdict(heavy.peak_bytes, shape)}; "
        "fwd_bwd: recompiled during the timed region (frames compiled +1, graphs +1)"
    )
    unfused = bench_timing.judge(shape, {"bwd": heavy}, {}, unfused=True)  # sdpa_math: S x S is what it is
    assert "error" not in unfused and unfused["bwd_tflops"] > 0
    fell_back = bench_timing.judge(shape, {"fwd": fine}, {"frames compiled": 1, "graph break: print": 1})
    assert fell_back["error"] == "fell back to eager code under torch.compile (graph break: print)"
    assert "fwd_tflops" not in fell_back


def _bench_args(*argv: str):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = ["--seqlen", "32", "--head-dim", "16", "--dtype", "float32", "--nheads", "2", "--tokens", "64"]
    small += ["--gqa", "no", "--causal", "no", "--mode", "fwd", "--warmup", "1", "--reps", "3", "--device", "cpu"]
    return parser.parse_args(small + list(argv))


def _compiled_peer(grow_after: int | None = None, graph_break: bool = False):
    """A peer through ``torch.compile`` (static shapes, eager backend: fast); from call
    ``grow_after`` on it passes one more key row, a shape not yet compiled."""
    import torch._dynamo

    def attention(q, k, v):
        if graph_break:
            torch._dynamo.graph_break()
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v

    compiled = torch.compile(attention, backend="eager", dynamic=False)
    calls = []

    def peer(q, k, v, causal):
        calls.append(1)
        if grow_after is not None and len(calls) > grow_after:
            k, v = torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    return peer


def test_a_peer_that_compiles_in_the_timed_region_or_falls_back_is_reported_failed(tmp_path, monkeypatch):
    """Through ``run_bench`` on the CPU: a peer that meets a new shape in its third call (the first
    call and one warm-up call come before the repetitions) recompiles in the timed region; a peer
    with a graph break ran eagerly; the same compiled peer without either is timed."""
    fake = {
        "steady": _compiled_peer(),
        "recompiles": _compiled_peer(grow_after=2),
        "breaks": _compiled_peer(graph_break=True),
    }
    monkeypatch.setattr(bench, "peers", lambda device_type: fake)
    args = _bench_args()
    rows = {row["peer"]: row for row in bench.run_bench(args, progress=lambda text: None)}
    assert "error" not in rows["steady"] and rows["steady"]["fwd_tflops"] > 0 and rows["steady"]["fwd_host_us"] > 0
    assert rows["recompiles"]["error"].startswith("fwd: recompiled during the timed region (frames compiled +1")
    assert rows["breaks"]["error"].startswith("fell back to eager code under torch.compile (graph break")
    for name in ("recompiles", "breaks"):
        assert "fwd_tflops" not in rows[name] and "fwd_ms" not in rows[name]
    table = bench.to_markdown(list(rows.values()), args.mode, "context")
    assert "| fwd TFLOP/s | fwd host us | peak MB | failed |" in table
    assert f"| n/a | n/a | n/a | {rows['recompiles']['error']} |" in table
    assert {r["peer"]: r["error"] for r in csv.DictReader(io.StringIO(bench.to_csv(list(rows.values()))))} == {
        name: row.get("error", "") for name, row in rows.items()
    }


def _recompile_limit(limit: int):
    """dynamo's recompile limit at ``limit`` inside the block, through dynamo's own ``config.patch``
    (setting the attribute directly leaves dynamo's config broken for the tests after this one)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    return config.patch(**{name: limit})


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the fallback, on purpose
def test_flex_compiles_once_per_shape_and_a_peer_past_the_recompile_limit_fails(monkeypatch):
    """FlexAttention (eager backend, fast) over two shapes with dynamo's recompile limit at 1:
    dynamo's caches are cleared before each shape, so both compile and are timed. Without that,
    the second shape goes past the limit, where dynamo runs the eager code: a failed row."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    import torch._dynamo

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: real_compile(fn, **{"backend": "eager", **kw}))
    args = _bench_args("--seqlen", "32,64")
    monkeypatch.setattr(bench, "peers", lambda device_type: {"flex": bench._flex()})
    with _recompile_limit(1):
        torch._dynamo.reset()
        rows = bench.run_bench(args, progress=lambda text: None)
        assert [row.get("error") for row in rows] == [None, None] and all(row["fwd_tflops"] > 0 for row in rows)
        monkeypatch.setattr(bench, "fresh_dynamo", lambda: None)
        torch._dynamo.reset()
        rows = bench.run_bench(args, progress=lambda text: None)
    torch._dynamo.reset()
    assert "error" not in rows[0]
    assert rows[1]["error"].startswith("fell back to eager code under torch.compile (unsupported: ")


def test_an_8_bit_peer_is_timed_forward_only(monkeypatch):
    """``sage_fp16`` (the 8-bit kernel, here through the interpreter) gets a forward figure; its
    backward modes are not timed, and the row says why."""
    monkeypatch.setattr(bench, "peers", lambda device_type: {"sage_fp16": bench._sage("fp16")})
    args = _bench_args("--dtype", "float16", "--head-dim", "64", "--mode", "fwd,bwd,fwd_bwd")
    (row,) = bench.run_bench(args, progress=lambda text: None)
    assert row["peer"] == "sage_fp16" and row["fwd_tflops"] > 0
    assert "bwd_tflops" not in row and "fwd_bwd_tflops" not in row
    assert row["error"] == "bwd, fwd_bwd: forward only (inference)"
    assert "sage_fp16" in bench.FORWARD_ONLY_PEERS and "sage_fp8" in bench.FORWARD_ONLY_PEERS
