"""The GPU campaign's plan, runner and report, on the CPU.

The plan is checked by parsing each step's command with the parser of the command it runs, so
what runs is what the targets name. The runner is checked with small steps that pass, fail, hang
(with a child process) or run ``flash-recipe bench`` on the CPU. The summaries are pure
functions, checked on rows made up here: those rows are test inputs, never reported numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from flash_recipe.tools import bench, campaign, tune, verify

PLAN = {step.name: step for step in campaign.build_plan(test_tree=campaign.find_test_tree())}


def _parse(add_arguments, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_plan_has_every_part_in_order_of_value_within_20_minutes():
    order = ["env", "host", "capture", "verify", "bench", "decode", "memory", "tests", "tune"]
    assert list(PLAN) == order
    total = sum(step.budget_s for step in PLAN.values())
    assert total + campaign.RESERVE_S <= campaign.TOTAL_BUDGET_S == 20 * 60
    assert all(step.budget_s > 0 for step in PLAN.values())
    tuned_first = [step.name for step in campaign.build_plan(tune_first=True)]
    assert tuned_first == ["env", "tune", *order[1:-1]]


def test_the_default_campaign_fits_9_minutes_and_says_what_it_leaves_out():
    fitted = campaign.fit(list(PLAN.values()), campaign.DEFAULT_MINUTES)
    ran = [step for step in fitted if not step.skip]
    assert campaign.DEFAULT_MINUTES == 9
    assert sum(step.budget_s for step in ran) + campaign.RESERVE_S <= 9 * 60
    assert [step.name for step in ran] == ["env", "host", "capture", "verify", "bench", "decode"]
    skipped = {step.name: step.skip for step in fitted if step.skip}
    assert set(skipped) == {"memory", "tests", "tune"}
    assert "does not fit in --minutes 9 (35 s needed, 15 s left" in skipped["memory"]
    everything = campaign.fit(list(PLAN.values()), 20)
    assert not any("does not fit" in (step.skip or "") for step in everything)  # the whole plan fits 20 minutes
    # A later, shorter step still runs where a longer one before it did not fit.
    shorter = campaign.fit(list(PLAN.values()), 8.5)  # 465 s: decode (60) does not fit after bench, memory (35) does
    assert [step.name for step in shorter if not step.skip] == ["env", "host", "capture", "verify", "bench", "memory"]
    with pytest.raises(SystemExit):
        campaign.build_parser().parse_args(["--out", "x", "--minutes", "0.5"])


def test_bench_step_measures_the_target_shapes_with_the_peers():
    argv = PLAN["bench"].command("/scratch")
    assert argv[1:4] == ["-m", "flash_recipe", "bench"]
    args = _parse(bench.add_arguments, argv[4:])
    assert args.dtype == ["bfloat16"] and args.head_dim == [128]
    assert args.seqlen == [4096, 8192, 16384] and args.causal == [False, True] and args.gqa == [False]
    assert set(args.mode) == {"fwd", "bwd", "fwd_bwd"}
    assert args.peer[:2] == ["flash_recipe", "sdpa_flash"]  # the two compared, side by side in one run
    assert {"sdpa_cudnn", "sdpa_efficient", "flex"} <= set(args.peer)
    assert args.json == "/scratch/bench.json"
    shapes = bench.shapes(args.seqlen, args.head_dim, args.causal, args.gqa, args.dtype, args.tokens, args.nheads)
    assert [s.id for s in shapes] == PLAN["bench"].params["shapes"] == [s.id for s in campaign.bench_shapes()]
    assert {(s.causal, s.seqlen) for s in shapes} == {(c, n) for c in (False, True) for n in (4096, 8192, 16384)}
    assert all(s.nheads == s.nheads_k and s.dtype == "bfloat16" and s.head_dim == 128 for s in shapes)


def test_verify_step_covers_bf16_and_the_kv_cache():
    argv = PLAN["verify"].command()
    assert argv[1:4] == ["-m", "flash_recipe", "verify"]
    args = _parse(verify.add_arguments, argv[4:])
    assert args.json and args.kvcache and args.grid == "full"
    assert args.dtype == ["bfloat16"] and args.backend is None
    assert PLAN["verify"].stdout_is_result


def test_memory_step_measures_32k_and_64k_against_sdpa_flash():
    argv = PLAN["memory"].command("/scratch")
    args = campaign.worker_parser().parse_args(argv[argv.index("--step") :])
    assert args.step == "memory" and args.seqlen == [32768, 65536]
    assert args.peer == ["flash_recipe", "sdpa_flash"] and args.result == "/scratch/memory.json"
    shapes = campaign.memory_shapes(args.seqlen)
    assert {(s.seqlen, s.causal) for s in shapes} == {(n, c) for n in (32768, 65536) for c in (False, True)}
    assert all(s.dtype == "bfloat16" and s.head_dim == 128 and s.batch == 1 for s in shapes)


def test_tune_step_covers_head_dims_64_and_128_in_bf16():
    argv = PLAN["tune"].command("/scratch")
    assert argv[1:4] == ["-m", "flash_recipe", "tune"]
    assert argv[4:8] == ["--head-dim", "64,128", "--dtype", "bfloat16"]
    args = _parse(tune.add_arguments, argv[4:])  # the subcommand's own parser
    assert args.head_dim == [64, 128] and args.dtype == ["bfloat16"] and args.json == "/scratch/tune.json"


def test_tests_step_runs_the_gpu_test_files_of_the_checkout():
    # This checkout's tests/ (the package under test may be an installed wheel, which has none beside it).
    tests = {s.name: s for s in campaign.build_plan(test_tree=Path(__file__).resolve().parent)}["tests"]
    assert tests.skip is None and tests.argv[1:3] == ["-m", "pytest"]
    assert any(arg.endswith("test_gpu.py") for arg in tests.argv) and "--junitxml" in tests.argv
    assert tests.cwd == str(Path(__file__).resolve().parents[1])
    without = {s.name: s for s in campaign.build_plan(test_tree=None)}["tests"]
    assert without.skip and "no test tree" in without.skip and without.argv == []


def test_budgets_can_be_changed_per_step(capsys, tmp_path):
    plan = {s.name: s for s in campaign.build_plan(budgets={"tune": 400})}
    assert plan["tune"].budget_s == 400 and plan["bench"].budget_s == campaign.BUDGETS_S["bench"]
    assert campaign.main(["--out", str(tmp_path), "--dry-run", "--budget", "tune=400"]) == 0
    assert "tune       400 s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        campaign.main(["--out", str(tmp_path), "--dry-run", "--budget", "tune=soon"])
    assert "expected STEP=SECONDS" in capsys.readouterr().err


def test_only_and_skip_choose_steps_and_env_always_stays():
    plan = list(PLAN.values())
    assert [s.name for s in campaign.select(plan, only=["bench", "verify"])] == ["env", "verify", "bench"]
    assert [s.name for s in campaign.select(plan, skip=["tests"])] == [
        "env",
        "host",
        "capture",
        "verify",
        "bench",
        "decode",
        "memory",
        "tune",
    ]
    with pytest.raises(ValueError, match="--only takes step names .* got nope"):
        campaign.select(plan, only=["nope"])


def test_dry_run_prints_and_writes_the_plan_and_runs_nothing(tmp_path, capsys, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("a dry run started a process")

    monkeypatch.setattr(campaign.steps.subprocess, "Popen", no_process)
    status = campaign.main(["--out", str(tmp_path / "out"), "--dry-run", "--skip", "tune", "--minutes", "20"])
    out = capsys.readouterr().out
    assert status == 0
    for text in ("verify", "--kvcache", "4096,8192,16384", "32768,65536", "sdpa_flash", "total budget", "20 min"):
        assert text in out
    assert "flash_recipe tune" not in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["campaign.json", "campaign.md"]
    report = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert report["dry_run"] and report["steps"] == {} and report["targets"] == []
    assert [s["name"] for s in report["plan"]] == [
        "env", "host", "capture", "verify", "bench", "decode", "memory", "tests"
    ]  # fmt: skip
    assert "Dry run" in (tmp_path / "out" / "campaign.md").read_text()


def test_a_default_dry_run_plans_9_minutes_and_its_report_starts_with_what_it_leaves_out(tmp_path, capsys):
    assert campaign.main(["--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "within 540 s (9 min); not run: memory, tests, tune;" in out
    assert "not run: does not fit in --minutes 9" in out
    report = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert report["budget_s"]["total"] == 540 and report["budget_s"]["steps"] + campaign.RESERVE_S <= 540
    head = (tmp_path / "out" / "campaign.md").read_text().splitlines()[:6]
    assert "- passed: none" in head
    assert any(line.startswith("- skipped: memory (does not fit in --minutes 9") for line in head), head


def test_without_cuda_the_campaign_refuses(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(campaign.cli, "cuda_available", lambda: False)
    assert campaign.main(["--out", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert campaign.main(["--out", str(tmp_path), "--only", "bench,typo"]) == 2


# ----------------------------------------------------------------------------- the runner


def _python_step(name: str, code: str, budget: int, **kwargs) -> campaign.Step:
    return campaign.Step(name, f"test step {name}", [sys.executable, "-c", textwrap.dedent(code)], budget, **kwargs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_runner_records_failures_and_stops_a_hung_step_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setattr(campaign.steps, "STOP_GRACE_S", 1)
    child_pid = tmp_path / "child.pid"
    plan = [
        _python_step("ok", "print('all good')", 30),
        _python_step("crash", "import sys; print('going down'); sys.exit(3)", 30),
        _python_step(
            "hang",
            f"""
            import subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open({str(child_pid)!r}, "w").write(str(child.pid))
            print("hanging", flush=True)
            time.sleep(120)
            """,
            3,
        ),
        campaign.Step("missing", "cannot start", ["/nonexistent/program"], 5),
        campaign.Step("later", "planned, not run", [], 5, skip="not here"),
    ]
    lines = []
    begin = time.monotonic()
    status = campaign.run_campaign(plan, tmp_path / "out", "test command", progress=lines.append)
    assert time.monotonic() - begin < 25
    assert status == 1
    report = json.loads((tmp_path / "out" / "campaign.json").read_text())
    steps = report["steps"]
    assert steps["ok"]["status"] == "passed" and steps["ok"]["returncode"] == 0
    assert steps["crash"]["status"] == "failed" and steps["crash"]["returncode"] == 3
    assert steps["hang"]["status"] == "timeout" and steps["hang"]["seconds"] < 15
    assert steps["missing"]["status"] == "error" and "could not start" in steps["missing"]["detail"]
    assert steps["later"]["status"] == "skipped"
    deadline = time.monotonic() + 5
    while _alive(int(child_pid.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(child_pid.read_text())), "the hung step's child outlived the step"
    log = (tmp_path / "out" / "campaign.log").read_text()
    for text in ("===== ok:", "all good", "going down", "hanging", "===== hang: timeout", "===== crash: failed"):
        assert text in log
    assert log.index("all good") < log.index("going down") < log.index("hanging")
    assert "going down" in steps["crash"]["output_tail"] and "all good" not in steps["crash"]["output_tail"]
    md = (tmp_path / "out" / "campaign.md").read_text()
    assert "| crash | failed |" in md and "| later | skipped |  | 5 s | not here |" in md
    assert any("campaign.md" in line for line in lines)


def test_a_campaign_on_the_cpu_end_to_end(tmp_path, monkeypatch):
    """env, bench (the CPU peers), verify (the reference backend) and pytest run for real, tune
    fails for want of a GPU; memory's rows come from a made-up step. So the collection of every
    kind of result, the targets, the tables, the plots and the single-folder output are exercised."""
    monkeypatch.setenv("FLASH_RECIPE_BACKEND", "reference")  # removed from the steps' environment
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the steps see no GPU, also on a machine with one
    rows = [
        {"peer": peer, "seqlen": n, "causal": False, "mode": "fwd", "peak_mb": mb}
        for peer, n, mb in (("flash_recipe", 32768, 100.0), ("flash_recipe", 65536, 200.0))
    ]
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_tiny.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\n"
                                        "def test_skip():\n    pytest.skip('no')\n")  # fmt: skip
    python = sys.executable
    bench_args = "--seqlen 32,64 --head-dim 16 --dtype float32 --nheads 2 --tokens 64 --gqa no --reps 2 --warmup 1"
    verify_args = "--json --kvcache --grid small --dtype float32 --backend reference"
    plan = [
        campaign.build_plan()[0],  # env
        campaign.Step(
            "verify", "verify", [python, "-m", "flash_recipe", "verify", *verify_args.split()], 120,
            result="verify.json", stdout_is_result=True,
        ),
        campaign.Step(
            "bench", "bench", [python, "-m", "flash_recipe", "bench", *bench_args.split(), "--json", "{scratch}/b"],
            120, result="b",
        ),
        _python_step(
            "memory",
            f"import json, os; json.dump({rows!r}, open('memory.json', 'w')); "
            "print(os.environ.get('FLASH_RECIPE_BACKEND'), os.environ.get('TRITON_INTERPRET'), "
            "os.environ['FLASH_RECIPE_TUNE_CACHE'])",
            30,
            result="memory.json",
        ),
        campaign.Step(
            "tests", "pytest", [python, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "--junitxml",
            "{scratch}/junit.xml"], 60, result="junit.xml", cwd=str(tmp_path),
        ),
        {s.name: s for s in campaign.build_plan()}["tune"],
    ]  # fmt: skip
    out = tmp_path / "out"
    status = campaign.run_campaign(plan, out, "test command", progress=lambda line: None)
    report = json.loads((out / "campaign.json").read_text())
    steps = report["steps"]
    assert status == 1 and [n for n, s in steps.items() if s["status"] != "passed"] == ["tune"], steps
    assert steps["tune"]["status"] == "failed" and steps["tune"]["detail"].startswith("exit status 2")
    assert report["environment"]["cuda"] is False and report["environment"]["versions"]["torch"]
    variables = report["environment"]["variables"]
    assert "TRITON_INTERPRET" not in variables and "FLASH_RECIPE_BACKEND" not in variables
    assert variables["FLASH_RECIPE_TUNE_CACHE"].endswith("tune-cache")  # empty: the shipped table is measured
    verify_data = steps["verify"]["data"]
    assert verify_data["passed"] and verify_data["backends"] == ["reference"]
    assert set(verify_data["counts"]) == {"attention/float32", "kvcache/float32"} and not verify_data["mismatches"]
    assert steps["verify"]["detail"].startswith("PASSED")
    assert steps["tests"]["data"]["passed"] == 1 and steps["tests"]["data"]["skipped"] == 1
    bench_rows = steps["bench"]["data"]["rows"]
    assert len(bench_rows) == 2 * 2 * 2 and steps["bench"]["data"]["complete"]
    assert {row["peer"] for row in bench_rows} == {"flash_recipe", "sdpa"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(p.name for p in out.iterdir()) == sorted(campaign.OUTPUT_FILES)
        assert (out / "bench-fwd.png").read_bytes()[:4] == b"\x89PNG"
        assert "![bench-fwd.png](bench-fwd.png)" in (out / "campaign.md").read_text()
    else:  # the plots are an optional extra: their absence is said in the report, and nothing else is missing
        assert sorted(p.name for p in out.iterdir()) == ["campaign.json", "campaign.log", "campaign.md"]
        assert "bench-fwd.png: not drawn (RuntimeError: --plot needs matplotlib" in (out / "campaign.md").read_text()
    targets = report["targets"]
    speed = [t for t in targets if t["target"].endswith("speed")]
    assert len(speed) == 2 * 6 and all(t["verdict"] == "MISS" for t in speed)
    assert all("sdpa_flash: not measured" in t["note"] for t in speed)  # no such peer on the CPU
    linear = next(t for t in targets if t["target"] == "fwd memory linear")
    assert linear["verdict"] == "PASS" and linear["ratio"] == pytest.approx(2.0)
    log = (out / "campaign.log").read_text()
    assert "None None " in log and "tune-cache" in log  # the steps' environment
    assert "fingerprint " + verify_data["fingerprint"] in log  # verify's table, written from its JSON
    md = (out / "campaign.md").read_text()
    for text in ("## Targets:", "## Steps", "## Peak memory", "## Bench", "## Verify", "## GPU tests", "## Tune"):
        assert text in md


# ----------------------------------------------------------------------------- the summaries


def _bench_row(peer, shape_id, **values):
    return {"peer": peer, "shape": shape_id, **values}


def test_speed_targets_ratio_verdict_and_missing_measurements():
    ids = ["S4096-full", "S4096-causal", "S8192-full"]
    rows = [
        _bench_row("flash_recipe", ids[0], fwd_tflops=500.0, bwd_tflops=330.0),
        _bench_row("sdpa_flash", ids[0], fwd_tflops=400.0, bwd_tflops=300.0),
        _bench_row("flash_recipe", ids[1], fwd_tflops=400.0, bwd_tflops=320.0),
        _bench_row("sdpa_flash", ids[1], fwd_tflops=330.0, bwd_tflops=300.0),
        _bench_row("flash_recipe", ids[2], error="OutOfMemoryError: no"),
        _bench_row("cudnn", ids[2], fwd_tflops=900.0),
    ]
    targets = {(t["mode"], t["shape"]): t for t in campaign.speed_targets(rows, ids)}
    assert len(targets) == 6
    first = targets[("fwd", ids[0])]
    assert first["ratio"] == pytest.approx(1.25) and first["verdict"] == "PASS"  # exactly the bar passes
    assert first["subject"] == 500.0 and first["reference"] == 400.0 and first["required"] == 1.25
    assert targets[("bwd", ids[0])]["verdict"] == "PASS"  # 1.1
    assert (
        targets[("fwd", ids[1])]["ratio"] == pytest.approx(400 / 330) and targets[("fwd", ids[1])]["verdict"] == "MISS"
    )
    assert targets[("bwd", ids[1])]["verdict"] == "MISS"  # 1.067 < 1.1
    missing = targets[("fwd", ids[2])]
    assert missing["verdict"] == "MISS" and missing["ratio"] is None
    assert "flash_recipe: OutOfMemoryError" in missing["note"] and "sdpa_flash: not measured" in missing["note"]


def _memory_row(peer, seqlen, mode, peak, causal=True):
    return {"peer": peer, "seqlen": seqlen, "mode": mode, "causal": causal, "peak_mb": peak}


def test_decode_step_times_eager_and_replay_and_judges_both():
    """The decode step runs bench_decode at Llama-3-8B's shape, eager and replayed from a CUDA graph;
    its targets: replayed >= SDPA's replay at every row and >= 80% of the copy bandwidth from an 8k
    cache at batch >= 8 (50% below); eager >= 0.9x SDPA at batch >= 8 from 8k. Unmeasured is a MISS."""
    argv = PLAN["decode"].command("/scratch")
    assert argv[1:3] == ["-m", "flash_recipe.tools.bench_decode"] and argv[-2:] == ["--json", "/scratch/decode.json"]
    assert "--cuda-graph" in argv

    def row(batch, cache, peer, gbs, graph_gbs=None):
        found = {"batch": batch, "cache": cache, "peer": peer, "bytes_per_s": gbs * 1e9}
        return found if graph_gbs is None else {**found, "graph_bytes_per_s": graph_gbs * 1e9}

    rows = [
        row(8, 1024, "flash_recipe", 500, 900),
        row(8, 1024, "sdpa", 800, 850),
        row(8, 8192, "flash_recipe", 2600, 3500),  # eager 0.93x SDPA: PASS; replay 0.875 of copy: PASS
        row(8, 8192, "sdpa", 2800, 3400),
        row(1, 8192, "flash_recipe", 500, 1900),  # batch 1: 0.475 of copy, under 0.5
        row(1, 8192, "sdpa", 1500, 1800),
        row(8, 32768, "flash_recipe", 2000),  # no replay timed
        {"batch": 8, "cache": 32768, "peer": "sdpa", "error": "OOM"},
    ]
    context = {"copy_bytes_per_s": 4000e9}
    targets = {(t["target"], t["shape"]): t for t in campaign.decode_targets(rows, context)}
    assert set(targets) == {
        ("decode eager vs sdpa", "B8-S8192"),
        ("decode eager vs sdpa", "B8-S32768"),  # only at batch >= 8 from 8k
        *(("decode replay vs sdpa", shape) for shape in ("B8-S1024", "B8-S8192", "B1-S8192", "B8-S32768")),
        *(("decode replay of copy", shape) for shape in ("B8-S8192", "B1-S8192", "B8-S32768")),  # from 8k
    }
    assert targets["decode eager vs sdpa", "B8-S8192"]["verdict"] == "PASS"
    assert targets["decode eager vs sdpa", "B8-S8192"]["ratio"] == pytest.approx(2600 / 2800)
    assert targets["decode replay vs sdpa", "B8-S1024"]["verdict"] == "PASS"  # eager is slower there: not judged
    assert targets["decode replay vs sdpa", "B1-S8192"]["verdict"] == "PASS"
    assert targets["decode replay of copy", "B8-S8192"]["verdict"] == "PASS"
    assert targets["decode replay of copy", "B8-S8192"]["required"] == 0.8
    assert targets["decode replay of copy", "B1-S8192"]["verdict"] == "MISS"
    assert targets["decode replay of copy", "B1-S8192"]["required"] == 0.5
    assert targets["decode replay of copy", "B1-S8192"]["ratio"] == pytest.approx(1900 / 4000)
    missed = targets["decode eager vs sdpa", "B8-S32768"]
    assert missed["verdict"] == "MISS" and "OOM" in missed["note"]
    assert targets["decode replay of copy", "B8-S32768"]["verdict"] == "MISS"
    no_copy = {(t["target"], t["shape"]): t for t in campaign.decode_targets(rows, None)}
    assert no_copy["decode replay of copy", "B8-S8192"]["note"] == "no copy bandwidth measured"


def test_memory_targets_ratio_and_linearity():
    rows = [
        _memory_row("flash_recipe", 32768, "fwd", 130.0),
        _memory_row("sdpa_flash", 32768, "fwd", 125.0),  # 1.04x: within 1.05
        _memory_row("flash_recipe", 65536, "fwd", 260.0),
        _memory_row("sdpa_flash", 65536, "fwd", 240.0),  # 1.083x: over
        _memory_row("flash_recipe", 32768, "fwd_bwd", 100.0),
        _memory_row("sdpa_flash", 32768, "fwd_bwd", 120.0),
        _memory_row("flash_recipe", 65536, "fwd_bwd", 400.0),  # quadratic growth
        _memory_row("sdpa_flash", 65536, "fwd_bwd", 240.0),
        {"peer": "flash_recipe", "seqlen": 32768, "mode": "fwd", "causal": False, "error": "OutOfMemoryError: x"},
    ]
    targets = {(t["target"], t["shape"]): t for t in campaign.memory_targets(rows)}
    assert targets[("fwd peak memory", "S32768-causal")]["verdict"] == "PASS"
    assert targets[("fwd peak memory", "S32768-causal")]["ratio"] == pytest.approx(130 / 125)
    assert targets[("fwd peak memory", "S65536-causal")]["verdict"] == "MISS"
    linear = targets[("fwd memory linear", "S65536/S32768-causal")]
    assert linear["ratio"] == pytest.approx(2.0) and linear["verdict"] == "PASS" and linear["required"] == 2.2
    assert linear["reference"] == pytest.approx(240 / 125)
    quadratic = targets[("fwd_bwd memory linear", "S65536/S32768-causal")]
    assert quadratic["ratio"] == pytest.approx(4.0) and quadratic["verdict"] == "MISS"
    assert targets[("fwd_bwd peak memory", "S65536-causal")]["verdict"] == "MISS"  # 400 / 240
    failed = targets[("fwd peak memory", "S32768-full")]
    assert failed["verdict"] == "MISS" and "OutOfMemoryError" in failed["note"]
    table = {(e["mode"], e["causal"], e["peer"]): e for e in campaign.memory_table(rows)}
    assert table[("fwd_bwd", True, "flash_recipe")]["growth"] == pytest.approx(4.0)


def test_parse_junit_counts_and_failures(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
        skipped="2" tests="7"><testcase classname="tests.test_gpu" name="test_a[x]"/>
        <testcase classname="tests.test_gpu" name="test_b"><failure message="assert 3 &lt;= 2">long</failure>
        </testcase><testcase classname="tests.test_kernels" name="test_c"><error message="fixture broke"/>
        </testcase></testsuite></testsuites>"""
    )
    result = campaign.parse_junit(path)
    assert (result["tests"], result["passed"], result["failures"], result["errors"], result["skipped"]) == (
        7,
        3,
        1,
        1,
        2,
    )
    assert [f["test"] for f in result["failed"]] == ["tests.test_gpu::test_b", "tests.test_kernels::test_c"]
    assert result["failed"][0]["message"] == "assert 3 <= 2"


def test_summarize_verify_counts_kinds_and_mismatches():
    def row(case, dtype, passed):
        return {"case": case, "dtype": dtype, "backend": "triton", "passed": passed, "errors": {}, "bounds": {}}

    report = {
        "passed": False,
        "fingerprint": "ab" * 32,
        "cases": [row("B1-Sq1", "float16", True), row("kv-B2", "float16", True), row("kv-B2", "bfloat16", False)],
    }
    summary = campaign.summarize_verify(report)
    assert summary["counts"] == {
        "attention/float16": {"checks": 1, "passed": 1},
        "kvcache/float16": {"checks": 1, "passed": 1},
        "kvcache/bfloat16": {"checks": 1, "passed": 0},
    }
    assert [r["dtype"] for r in summary["mismatches"]] == ["bfloat16"]


def test_target_summary_per_kind():
    targets = [
        {"target": "fwd speed", "verdict": "PASS", "ratio": 1.3, "required": 1.25},
        {"target": "fwd speed", "verdict": "MISS", "ratio": 1.2, "required": 1.25},
        {"target": "fwd peak memory", "verdict": "PASS", "ratio": 0.9, "required": 1.05},
        {"target": "fwd peak memory", "verdict": "PASS", "ratio": 1.01, "required": 1.05},
        {"target": "bwd speed", "verdict": "MISS", "ratio": None, "required": 1.1},
    ]
    summary = {s["target"]: s for s in campaign.summarize_targets(targets)}
    assert summary["fwd speed"]["verdict"] == "MISS" and summary["fwd speed"]["worst_ratio"] == 1.2
    assert summary["fwd peak memory"]["verdict"] == "PASS" and summary["fwd peak memory"]["worst_ratio"] == 1.01
    assert summary["bwd speed"]["worst_ratio"] is None and summary["bwd speed"]["passed"] == 0


def test_peers_this_machine_lacks_are_dropped_from_the_bench_command():
    step, dropped = campaign.without_unavailable_peers(PLAN["bench"], ["flash_recipe", "sdpa_flash", "sdpa_efficient"])
    args = _parse(bench.add_arguments, step.command()[4:])
    assert args.peer == ["flash_recipe", "sdpa_flash", "sdpa_efficient"]
    assert dropped == ["sdpa_cudnn", "flex", "flash_recipe_pointers"]
    assert args.seqlen == [4096, 8192, 16384] and PLAN["bench"].argv.count("--peer") == 6  # the plan is unchanged


def test_memory_worker_reports_what_it_cannot_measure(tmp_path, capsys):
    """Each (shape, mode, peer) is a row; one that cannot be measured says why, and the step exits 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU these rows are measured")
    result = tmp_path / "memory.json"
    argv = ["--step", "memory", "--result", str(result), "--seqlen", "64", "--peer", "flash_recipe", "--peer", "flex"]
    assert campaign.main(argv) == 1
    rows = json.loads(result.read_text())
    assert [(r["causal"], r["mode"], r["peer"]) for r in rows] == [
        (causal, mode, peer)
        for causal in (False, True)
        for mode in ("fwd", "fwd_bwd")
        for peer in ("flash_recipe", "flex")
    ]
    assert all(r["seqlen"] == 64 and r["dtype"] == "bfloat16" and r["head_dim"] == 128 for r in rows)
    assert {r["error"] for r in rows if r["peer"] == "flash_recipe"} == {
        "ValueError: peak memory needs a CUDA device, got 'cpu'"
    }
    assert {r["error"] for r in rows if r["peer"] == "flex"} == {"ValueError: peer 'flex' is not available on cpu"}
    assert len(capsys.readouterr().out.splitlines()) == len(rows)


def test_host_and_capture_steps_run_their_tools_and_reach_the_report(tmp_path):
    """The host step runs the campaign's own worker (host_cost, launches stubbed and real), the
    capture step capture_check; what they leave is collected and shown in the report."""
    from flash_recipe.tools import capture_check, host_cost
    from flash_recipe.tools.campaign import report as campaign_report
    from flash_recipe.tools.campaign import steps as campaign_steps
    from flash_recipe.tools.campaign import workers

    host_argv = PLAN["host"].command("/scratch")
    assert host_argv[1:] == ["-m", "flash_recipe.tools.campaign", "--step", "host", "--result", "/scratch/host.json"]
    assert workers.worker_parser().parse_args(host_argv[3:]).step == "host"
    assert PLAN["host"].params["cases"] == list(host_cost.CASES)
    capture_argv = PLAN["capture"].command("/scratch")
    assert capture_argv[1:] == ["-m", "flash_recipe.tools.capture_check", "--json", "/scratch/capture.json"]
    assert PLAN["capture"].params["checks"] == list(capture_check.CHECKS)

    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir(), out.mkdir()
    host_rows = [
        {"case": "kvcache", "calls": 64, "us": 41.0, "sdpa_us": 20.0, "ratio": 2.05, "stubbed": True},
        {"case": "kvcache", "calls": 64, "us": 48.5, "sdpa_us": 21.0, "ratio": 2.31, "stubbed": False},
    ]
    (scratch / "host.json").write_text(json.dumps({"shape": "B8-H32-Hk8-D128-S8192-bfloat16", "rows": host_rows}))
    capture_rows = [
        {"check": "kvcache", "status": "passed", "detail": "replay equals eager"},
        {"check": "compile", "status": "error", "detail": "RuntimeError: capture read a tensor"},
    ]
    (scratch / "capture.json").write_text(json.dumps({"rows": capture_rows}))
    report = campaign_report.new_report([PLAN["host"], PLAN["capture"]], "c", dry_run=False)
    for name in ("host", "capture"):
        record = {"status": "passed", "detail": "1 s", "output_tail": ""}
        report["steps"][name] = campaign_steps.collect(PLAN[name], record, scratch, out, io.BytesIO())
    assert report["steps"]["host"]["detail"] == "2 rows, at most 48 us per call with real launches"
    assert report["steps"]["capture"]["detail"].startswith("1 of 2 capture checks passed")
    text = campaign_report.render_markdown(report)
    assert "| kvcache | real | 64 | 48.5 | 21.0 | 2.31 |" in text
    assert "| compile | error | RuntimeError: capture read a tensor |" in text


def test_capture_check_needs_a_gpu(capsys, monkeypatch):
    from flash_recipe.tools import capture_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert capture_check.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
