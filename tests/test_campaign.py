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
import math
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

# The plan with this checkout's test tree (the package may be an installed wheel, with none beside it).
from devtools import campaign, gpu_check_cases
from flash_recipe.ops import tuned
from flash_recipe.tools import bench, tune, verify

# The plan with this checkout's test tree (the package may be an installed wheel, with none beside it).
PLAN = {step.name: step for step in campaign.build_plan(test_tree=Path(__file__).resolve().parent)}


def _parse(add_arguments, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


ORDER = [
    "env",
    "warmup",
    "check",
    "shootout",
    "bench",
    "host",
    "decode",
    "memory",
    "capture",
    "verify",
    "tests",
    "tune",
]


def test_plan_has_every_part_in_order_of_value_within_its_total():
    order = ORDER
    assert list(PLAN) == order
    total = sum(step.budget_s for step in PLAN.values())
    assert total + campaign.RESERVE_S <= campaign.TOTAL_BUDGET_S == 24 * 60
    assert all(step.budget_s > 0 for step in PLAN.values())
    tuned_first = [step.name for step in campaign.build_plan(tune_first=True)]
    assert tuned_first == ["env", "tune", *order[1:-1]]


def test_the_default_campaign_fits_9_minutes_and_says_what_it_leaves_out():
    fitted = campaign.fit(list(PLAN.values()), campaign.DEFAULT_MINUTES)
    ran = [step for step in fitted if not step.skip]
    assert campaign.DEFAULT_MINUTES == 9
    assert sum(step.budget_s for step in ran) + campaign.RESERVE_S <= 9 * 60
    assert [step.name for step in ran] == ["env", "warmup", "check", "shootout", "bench", "host"]
    skipped = {step.name: step.skip for step in fitted if step.skip}
    assert set(skipped) == {"decode", "memory", "capture", "verify", "tests", "tune"}
    assert "(144 s needed, 24 s of them compiling ahead in warmup, 12 s left" in skipped["verify"]
    everything = campaign.fit(list(PLAN.values()), campaign.TOTAL_BUDGET_S / 60)
    assert not any(step.skip for step in everything)  # the whole plan fits its total
    # A later, shorter step still runs where a longer one before it did not fit.
    # 345 s: bench (190) does not fit after shootout, host (30) does, decode (60) not then, memory (35) does
    shorter = campaign.fit(list(PLAN.values()), 6.5)
    assert [step.name for step in shorter if not step.skip] == ["env", "warmup", "check", "shootout", "host", "memory"]
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


def _warmup_args(step: campaign.Step):
    from devtools import warmup as campaign_warmup
    from flash_recipe.tools import warmup

    argv = step.command("/scratch")
    assert argv[1:3] == ["-m", "devtools.warmup"]
    campaign_warmup.add_steps()  # what the module adds before it parses --for
    args = _parse(warmup.add_arguments, argv[3:])
    return args, warmup.parse_for(args.step)


def test_warmup_compiles_ahead_for_the_steps_that_run_with_a_budget_sized_for_them():
    from flash_recipe.tools import warmup

    fitted = {s.name: s for s in campaign.fit(list(PLAN.values()), 9)}
    args, items = _warmup_args(fitted["warmup"])
    assert items == [("check", None), ("bench", None)] and args.tests is None
    assert args.jobs == campaign.plan.warmup_jobs() == max(1, min(os.cpu_count() or 1, 16))
    assert args.json == "/scratch/warmup.json" and fitted["warmup"].result == "warmup.json"
    budget = campaign.plan.WARMUP_START_S + campaign.plan.warmup_share("check") + campaign.plan.warmup_share("bench")
    assert fitted["warmup"].budget_s == budget == campaign.plan.warmup_budget(["check", "bench"])
    # The check's 98 variants measured at 101.2 s one after another: 16 processes, twice as slow, plus recording.
    assert campaign.plan.warmup_share("check") == math.ceil(6 + 2 * 102 / 16)
    everything = {s.name: s for s in campaign.fit(list(PLAN.values()), 30)}
    args, items = _warmup_args(everything["warmup"])
    assert items == [("check", None), ("bench", None), ("verify", ["bfloat16"]), ("tests", None)]
    assert args.tests == str(Path(__file__).resolve().parent)
    assert len(warmup.calls_for(items[:3])) > 0  # the campaign's --for is one warmup takes
    only_bench = {s.name: s for s in campaign.fit(campaign.select(list(PLAN.values()), only=["bench"]), 9)}
    assert _warmup_args(only_bench["warmup"])[1] == [("bench", None)]
    assert only_bench["warmup"].budget_s == campaign.plan.warmup_budget(["bench"])
    given = {s.name: s for s in campaign.build_plan(budgets={"warmup": 100})}
    given = {s.name: s for s in campaign.fit(list(given.values()), 9)}
    assert given["warmup"].budget_s == 100 and _warmup_args(given["warmup"])[1][:1] == [("check", None)]
    nothing = campaign.fit(campaign.select(list(PLAN.values()), skip=["check", "bench", "verify", "tests"]), 20)
    assert {s.name: s.skip for s in nothing}["warmup"] == "none of the steps it compiles for runs"


def test_check_step_runs_the_gpu_check_within_its_budget():
    from devtools import gpu_check

    argv = PLAN["check"].command("/scratch")
    assert argv[1:3] == ["-m", "devtools.gpu_check"]
    args = gpu_check.build_parser().parse_args(argv[3:])
    assert args.json == "/scratch/check.json" and args.fuzz and args.grid is None and args.dtype is None
    assert args.seconds == PLAN["check"].budget_s - campaign.plan.CHECK_MARGIN_S > 0
    longer = {s.name: s for s in campaign.build_plan(budgets={"check": 200})}["check"]
    assert gpu_check.build_parser().parse_args(longer.command()[3:]).seconds == 200 - campaign.plan.CHECK_MARGIN_S
    assert PLAN["check"].params["dtypes"] == ["bfloat16", "float16"]
    for feature in ("GQA", "Sq!=Sk", "D256", "varlen", "paged", "append", "window", "softcap", "ALiBi", "dropout"):
        assert feature in PLAN["check"].params["covers"]


def test_check_and_warmup_results_lead_the_report(tmp_path):
    """A real (tiny, interpreter) check result and a warmup summary, collected: the check's line
    opens the report, and both have their tables."""
    from devtools import gpu_check
    from devtools.campaign import report as campaign_report
    from devtools.campaign import steps as campaign_steps

    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir(), out.mkdir()
    doc = gpu_check.run(gpu_check.TINY_TABLE[:1], ["float32"], torch.device("cpu"), 60, fuzz=False,
                        progress=lambda line: None)  # fmt: skip
    doc["summary"] = gpu_check.summary(doc)
    (scratch / "check.json").write_text(json.dumps(doc))
    families = {"fwd": {"variants": 3, "sum_s": 9.0, "max_s": 4.0}, "bwd": {"variants": 9, "sum_s": 30.5, "max_s": 6.0}}
    warm = {"step": "check,bench", "device": "NVIDIA H100", "families": families, "variants": 12, "errors": 0,
            "sum_s": 39.5, "wall_s": 7.1, "jobs": 16, "rows": [{"variant": "x"}]}  # fmt: skip
    (scratch / "warmup.json").write_text(json.dumps(warm))
    plan = campaign.fit(list(PLAN.values()), 9)
    report = campaign_report.new_report(plan, "c", dry_run=False)
    by_name = {s.name: s for s in plan}
    for name in ("check", "warmup"):
        record = {"status": "passed", "detail": "exit status 0", "output_tail": ""}
        report["steps"][name] = campaign_steps.collect(by_name[name], record, scratch, out, io.BytesIO())
    assert "rows" not in report["steps"]["warmup"]["data"]
    assert report["steps"]["warmup"]["detail"].startswith("12 variants, 0 failed, 40 s of first calls in 7 s with 16")
    assert "bwd 30 s (9), fwd 9 s (3)" in report["steps"]["warmup"]["detail"]
    text = campaign_report.render_markdown(report)
    head = text.splitlines()[2]
    assert head.startswith("- correctness on the GPU (passed): PASSED: 1 of 1 table checks"), head
    assert "## Correctness on the GPU" in text and "## Compiled ahead" in text
    assert f"| {gpu_check.TINY_TABLE[0].id} | float32 | torch_math |" in text
    assert "| bwd | 9 | 30.5 | 6.00 |" in text
    doc["rows"][0]["passed"] = doc["passed"] = False  # a failed check fails the step, whatever its exit status
    (scratch / "check.json").write_text(json.dumps(doc))
    record = {"status": "passed", "detail": "exit status 0", "output_tail": ""}
    assert campaign_steps.collect(by_name["check"], record, scratch, out, io.BytesIO())["status"] == "failed"


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
    assert args.seconds == campaign.BUDGETS_S["tune"] - campaign.plan.TUNE_MARGIN_S
    given = {s.name: s for s in campaign.build_plan(budgets={"tune": 400})}["tune"].command("/scratch")
    assert _parse(tune.add_arguments, given[4:]).seconds == 400 - campaign.plan.TUNE_MARGIN_S  # follows the budget


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
    assert [s.name for s in campaign.select(plan, only=["bench", "verify"])] == ["env", "warmup", "bench", "verify"]
    assert [s.name for s in campaign.select(plan, only=["memory"])] == ["env", "memory"]  # nothing to compile ahead
    assert [s.name for s in campaign.select(plan, skip=["tests"])] == [n for n in ORDER if n != "tests"]
    assert [s.name for s in campaign.select(plan, only=["check"], skip=["warmup"])] == ["env", "check"]
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
    assert "--kernel fwd,decode" not in out  # the tune step's; the shoot-out runs flash-recipe tune too
    assert "--kernel bwd_dq,bwd_dkdv,bwd_onepass,bwd_onelaunch" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["campaign.json", "campaign.md"]
    report = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert report["dry_run"] and report["steps"] == {} and report["targets"] == []
    assert [s["name"] for s in report["plan"]] == ORDER[:-1]
    assert "Dry run" in (tmp_path / "out" / "campaign.md").read_text()


def test_a_default_dry_run_plans_9_minutes_and_its_report_starts_with_what_it_leaves_out(tmp_path, capsys):
    assert campaign.main(["--out", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "within 540 s (9 min); not run: decode, memory, capture, verify, tests, tune;" in out
    assert "not run: does not fit in --minutes 9" in out
    report = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert report["budget_s"]["total"] == 540 and report["budget_s"]["steps"] + campaign.RESERVE_S <= 540
    head = (tmp_path / "out" / "campaign.md").read_text().splitlines()[:6]
    assert "- passed: none" in head
    assert any(line.startswith("- skipped: decode (does not fit in --minutes 9") for line in head), head


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
    """env, the correctness check (its tiny table, through the interpreter), bench (the CPU peers),
    verify (the reference backend) and pytest run for real, tune fails for want of a GPU; memory's
    rows come from a made-up step. So the collection of every kind of result, the targets, the
    tables, the plots and the single-folder output are exercised."""
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
    check_argv = [python, "-m", "devtools.gpu_check", "--json", "{scratch}/check.json", "--fuzz-cases", "2"]
    plan = [
        campaign.build_plan()[0],  # env
        # The steps run without TRITON_INTERPRET; the check needs it without a GPU.
        campaign.Step("check", "check", ["env", "TRITON_INTERPRET=1", *check_argv], 120, result="check.json"),
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
    assert steps["check"]["data"]["passed"] and steps["check"]["data"]["fuzz"]["cases"] == 2
    checks = 2 * len(gpu_check_cases.TINY_TABLE)  # the interpreter's table in float16 and float32
    first = f"- correctness on the GPU (passed): PASSED: {checks} of {checks} table"
    assert md.splitlines()[2].startswith(first), md[:400]
    assert "## Correctness on the GPU" in md and "bfloat16 skipped: the Triton interpreter" in md


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
    """The host step runs the campaign's own worker (host_cost, launches stubbed and real, a
    torch.profiler trace per case), the capture step capture_check; what they leave is collected
    and shown in the report."""
    from devtools import capture_check
    from devtools.campaign import report as campaign_report
    from devtools.campaign import steps as campaign_steps
    from devtools.campaign import workers
    from flash_recipe.tools import host_cost

    host_argv = PLAN["host"].command("/scratch")
    assert host_argv[1:] == ["-m", "devtools.campaign", "--step", "host", "--result", "/scratch/host.json"]
    assert workers.worker_parser().parse_args(host_argv[3:]).step == "host"
    assert PLAN["host"].params["cases"] == list(host_cost.CASES)
    capture_argv = PLAN["capture"].command("/scratch")
    assert capture_argv[1:] == ["-m", "devtools.capture_check", "--json", "/scratch/capture.json"]
    assert PLAN["capture"].params["checks"] == list(capture_check.CHECKS)

    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir(), out.mkdir()
    host_rows = [
        {"case": "kvcache", "calls": 64, "us": 41.0, "sdpa_us": 20.0, "ratio": 2.05, "stubbed": True},
        {"case": "kvcache", "calls": 64, "us": 48.5, "sdpa_us": 21.0, "ratio": 2.31, "stubbed": False},
    ]
    profiles = {"kvcache": [{"name": "cuLaunchKernelEx", "calls": 4.0, "self_cpu_us": 9.5}]}
    host = {"shape": "B8-H32-Hk8-D128-S8192-bfloat16", "rows": host_rows, "profiles": profiles}
    (scratch / "host.json").write_text(json.dumps(host))
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
    assert "kvcache, torch.profiler's top entries by self CPU time, per call:" in text
    assert "| cuLaunchKernelEx | 4.0 | 9.5 |" in text
    assert "| compile | error | RuntimeError: capture read a tensor |" in text


def test_capture_check_needs_a_gpu(capsys, monkeypatch):
    from devtools import capture_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert capture_check.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_shootout_runs_right_after_the_check_and_times_each_backward_path_with_four_configs_at_most():
    """The shoot-out is ``flash-recipe tune`` of the backward kernels and so of every path
    (``Tuner.best_path``), bf16 at head dims 128 then 64 at the training shapes, with at most 4
    configurations per kernel, starting no head dim past its budget less the margin (``--seconds``),
    writing its file apart from every other step's tune cache."""
    assert ORDER.index("shootout") == ORDER.index("check") + 1
    step = PLAN["shootout"]
    assert step.budget_s == campaign.BUDGETS_S["shootout"] == 150
    argv = step.command("/scratch")
    assert argv[1:4] == ["-m", "flash_recipe", "tune"]
    args = _parse(tune.add_arguments, argv[4:])
    assert args.kernel == ["bwd_dq", "bwd_dkdv", "bwd_onepass", "bwd_onelaunch"] and args.head_dim == [128, 64]
    assert args.seconds == 150 - campaign.plan.TUNE_MARGIN_S
    assert args.dtype == ["bfloat16"] and args.seqlen == [4096, 16384] and args.causal == "both"
    assert args.max_candidates == 4 and args.tokens == 16384 and args.nheads == 16
    assert args.json == "/scratch/shootout.json" and not args.no_save
    env = step.environment({"FLASH_RECIPE_TUNE_CACHE": "/scratch/tune-cache", "OTHER": "1"}, "/scratch")
    assert env == {"FLASH_RECIPE_TUNE_CACHE": "/scratch/measured", "OTHER": "1"}
    assert PLAN["bench"].environment({"FLASH_RECIPE_TUNE_CACHE": "x"}, "/scratch") == {"FLASH_RECIPE_TUNE_CACHE": "x"}


def test_the_shootout_leaves_the_measured_file_to_commit_and_the_report_shows_what_it_chose(tmp_path):
    """What the shoot-out wrote (a ``flash-recipe tune`` report and its file, made up here) lands in
    ``measured/`` beside the report, and the report's section names the path kept per head dim."""
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    (scratch / "measured").mkdir(parents=True)
    out.mkdir()
    document = {"format": 1, "key": {"gpu": "NVIDIA H200", "target": "sm90", "triton": "3.6.0", "flash_recipe": "0"}}
    (scratch / "measured" / "NVIDIA-H200.tune.json").write_text(json.dumps(document))
    found = {
        "backward": [
            {"head_dim": 128, "element_size": 2, "path": "one_pass", "default": "three_kernels", "speedup": 1.2,
             "ms": {"one_pass": {"a": 1.0, "b": 4.0}, "three_kernels": {"a": 1.2, "b": 4.8}}},
        ],
        "configs": [tuned.config_entry("bwd_dq", 128, 2, (64, 128, 8, 2), speedup=1.05, table=[128, 64, 8, 2])],
    }  # fmt: skip
    (scratch / "shootout.json").write_text(json.dumps(found))
    record = {"name": "shootout", "status": "passed", "detail": "exit status 0", "output_tail": ""}
    record = campaign.collect(PLAN["shootout"], record, scratch, out, io.BytesIO())
    assert record["data"]["files"] == ["measured/NVIDIA-H200.tune.json"]
    assert json.loads((out / "measured" / "NVIDIA-H200.tune.json").read_text()) == document
    text = "\n".join(campaign.report._shootout_section(record))
    assert "| 128 | 2 | one_pass | three_kernels | 1.2 | one_pass 2, three_kernels 2.4 |" in text
    assert "bwd_dq d128: 64x128 w8 s2, 1.05x the table's [128, 64, 8, 2]" in text
    assert "commit it as `flash_recipe/measured/NVIDIA-H200.tune.json`" in text
    assert "Not started" not in text
    found["not_reached"] = [{"head_dim": 64, "dtypes": ["bfloat16"]}]
    (scratch / "shootout.json").write_text(json.dumps(found))
    record = {"name": "shootout", "status": "passed", "detail": "exit status 0", "output_tail": ""}
    record = campaign.collect(PLAN["shootout"], record, scratch, out, io.BytesIO())
    text = "\n".join(campaign.report._shootout_section(record))
    assert "Not started within the step's budget: d64 (bfloat16); `--budget shootout=S` gives it more." in text
