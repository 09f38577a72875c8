"""``flash-recipe warmup``: the variant list covers what a step launches, the parallel runner runs
its jobs in N processes, and a replayed variant compiles what the real launch compiles.

The lists are recorded with Triton's launch stubbed (nothing compiles or runs), under the
interpreter or planned as for sm90 (``warmup.offline_planning``); only the last test compiles, in
a fresh process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from offline import compile_in_subprocess

from devtools import splits_report
from devtools import warmup as campaign_warmup
from flash_recipe.tools import cli, verify, warmup, warmup_calls

CPU = torch.device("cpu")
TESTS = Path(__file__).resolve().parent  # ``nox -s tests`` imports the installed wheel: no tests/ beside it


@pytest.fixture(autouse=True)
def campaign_steps():
    """The campaign's steps (``devtools.warmup``) added to ``--for``, as the campaign runs it; the
    package's own list restored afterwards."""
    package_steps = dict(warmup_calls.STEP_CALLS)
    campaign_warmup.add_steps()
    yield
    warmup_calls.STEP_CALLS.clear()
    warmup_calls.STEP_CALLS.update(package_steps)


def test_the_package_alone_warms_what_users_run():
    """``flash-recipe warmup`` of an installed wheel: ``common`` and ``verify``; the campaign's
    steps come only from the checkout's ``devtools.warmup``."""
    added = set(warmup_calls.STEP_CALLS) - {"common", "verify"}
    assert added == {"tests", "bench", "check"}
    for name in added:
        del warmup_calls.STEP_CALLS[name]
    assert warmup_calls.steps() == ("common", "verify", "all")
    with pytest.raises(ValueError, match="--for takes steps of common, verify, all .* got 'check'"):
        warmup.parse_for("check")


def _keys(variants) -> set:
    return {variant.key for variant in variants}


def _launched(fn) -> set:
    """The variant keys of the launches ``fn()`` makes, Triton's launch stubbed."""
    with warmup.recorded_launches() as launches:
        fn()
    return {warmup.to_variant(kernel, args, kwargs, "truth").key for kernel, args, kwargs in launches}


@pytest.mark.parametrize("step", ["common", "verify", "tests", "bench", "check"])
def test_every_step_lists_distinct_variants_of_every_family_it_calls(step):
    """Planned as for sm90, so bf16 calls (which the interpreter's backend refuses) are listed too."""
    calls = warmup_calls.step_calls(step, tests=TESTS)
    assert calls and len({call.id for call in calls}) == len(calls)
    if step in ("verify", "tests"):  # keeps the test fast
        calls = warmup.narrow(calls, ["bfloat16"]) if step == "verify" else warmup.narrow(calls, head_dims=[16, 32])
    found, skipped = warmup.variants(calls, CPU, "sm90")
    assert found and not skipped
    assert len(_keys(found)) == len(found) and len({v.id for v in found}) == len(found)
    families = {v.family for v in found}
    assert {"fwd", "bwd"} <= families or {"fwd_general", "bwd"} <= families, families
    if step in ("verify", "check"):
        assert {"decode", "kvcache_append", "split_combine"} <= families, families
    if step == "check":
        assert "dropout_mask" in families and {v.dtype for v in found} == {"bfloat16", "float16", "-"}
    assert {v.dtype for v in found} - {"-"} <= set(warmup.DTYPES)  # "-": a kernel with no floating tensor


def test_verify_list_is_exactly_what_verify_launches_and_a_dropped_variant_shows():
    """The truth is ``verify`` itself (small grids, KV grid included, the triton backend), its
    launches recorded; the list comes from the step's calls. Dropping any one variant, or the KV
    grid's calls, leaves launches uncovered."""
    dtypes = ["float16", "float32"]  # what the interpreter's backend runs
    truth = _launched(lambda: verify.verify(["triton"], "small", dtypes, "cpu", kvcache=True))
    calls = warmup.narrow(warmup_calls.step_calls("verify", grid="small"), dtypes)
    listed, skipped = warmup.variants(calls, CPU)
    assert not skipped
    assert truth == _keys(listed)
    for dropped in (listed[0], listed[len(listed) // 2], listed[-1]):
        assert truth - _keys(v for v in listed if v is not dropped) == {dropped.key}
    dense_only, _ = warmup.variants([c for c in calls if "kv-" not in c.id], CPU)
    missing = {key[0].split(":")[1] for key in truth - _keys(dense_only)}
    assert {"rotary_append_kernel", "split_combine_kernel"} <= missing


def test_tests_list_covers_the_kernel_tests_own_calls():
    """test_kernels' accuracy test calls ``verify.check_case`` on the triton backend: its launches
    are in the ``--for tests`` list (recorded under the interpreter, as that test runs here)."""
    import test_kernels

    cases = [c for c in test_kernels.CASES if c.head_dim <= 32][:6]
    truth = set()
    for case in cases:
        truth |= _launched(lambda case=case: verify.check_case(case, torch.float16, CPU, "triton", seed=0))
    calls = warmup.narrow(warmup_calls.step_calls("tests", tests=TESTS), ["float16"], [16, 32])
    listed, _ = warmup.variants(calls, CPU)
    assert truth and truth <= _keys(listed)


def test_the_gpu_test_dtypes_are_those_test_gpu_runs():
    import test_gpu

    marks = [m for m in test_gpu.test_accuracy_at_scale.pytestmark if m.args and m.args[0] == "dtype"]
    assert [str(d).replace("torch.", "") for d in marks[0].args[1]] == list(campaign_warmup.TEST_GPU_DTYPES)
    assert {file for file, _, _ in campaign_warmup.gpu_test_tables(TESTS)} == {"test_gpu", "test_kernels"}


def test_for_takes_several_steps_each_narrowed_to_its_dtypes(capsys):
    items = warmup.parse_for("check,bench,verify:bfloat16,verify:float16,common:float32,common")
    assert items == [("check", None), ("bench", None), ("verify", ["bfloat16", "float16"]), ("common", None)]
    calls = warmup.calls_for(warmup.parse_for("verify:bfloat16,bench"))
    verify_calls = [c for c in calls if c.id.startswith("verify:")]
    assert verify_calls and {c.dtype for c in verify_calls} == {"bfloat16"}
    assert any(c.id.startswith("bench:") for c in calls) and len({c.id for c in calls}) == len(calls)
    for text, message in (
        ("check,sparse", "--for takes steps of common, verify, tests, bench, check, all .* got 'sparse'"),
        ("verify:int8", "--for verify:int8: the dtype must be one of float16, bfloat16, float32, got 'int8'"),
        (",", "--for needs at least one step"),
    ):
        with pytest.raises(ValueError, match=message):
            warmup.parse_for(text)
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--for", "verify:int8"])
    assert "the dtype must be one of" in capsys.readouterr().err


def test_offline_targets_are_those_with_a_known_multiprocessor_count():
    assert set(warmup.OFFLINE_TARGETS) == {target for _, target in splits_report.TABLE_GPUS}


def test_without_a_test_tree_tests_says_why(tmp_path, monkeypatch):
    """A devtools folder without the checkout's tests/ beside it."""
    monkeypatch.setattr(campaign_warmup, "TESTS", tmp_path / "tests")
    with pytest.raises(FileNotFoundError, match="checkout's tests/ folder.*name the folder with --tests"):
        warmup_calls.step_calls("tests")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no test_gpu.py"):
        warmup_calls.step_calls("all", tests=tmp_path)


@pytest.mark.parametrize(
    "kernel, constants, seqlen_q, expected",
    [
        ("attn_fwd_kernel", {}, 128, "fwd"),
        ("attn_fwd_kernel", {"SOFTCAP": True}, 128, "fwd_general"),
        ("attn_fwd_kernel", {"KV_RANGES": True}, 1, "decode"),
        ("attn_fwd_kernel", {"KV_RANGES": True}, 128, "fwd_general"),
        ("attn_fwd_kernel", {"KV_RANGES": True, "VARLEN": True}, 1, "fwd_general"),
        ("attn_bwd_dq_kernel", {}, 128, "bwd"),
        ("rotary_append_kernel", {}, None, "kvcache_append"),
        ("split_combine_kernel", {}, 1, "split_combine"),
    ],
)
def test_families(kernel, constants, seqlen_q, expected):
    assert warmup.family(kernel, constants, seqlen_q) == expected


# -- the parallel runner (stand-in work, no compiling) -----------------------------------------


def rendezvous(job: tuple) -> dict:
    """A stand-in compile: checks in, then waits (up to 30 s) until ``workers`` processes have."""
    folder, workers = job
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(folder)) < workers and time.monotonic() < deadline:
        time.sleep(0.02)
    return {"family": "stand-in", "seen": len(os.listdir(folder))}


def test_the_runner_runs_n_jobs_at_once_and_merges_their_rows(tmp_path):
    """Each job waits until two workers have checked in, which only two concurrent workers satisfy."""
    rows, wall = warmup.run_jobs([(str(tmp_path), 2)] * 4, rendezvous, 2)
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert all(row["seen"] == 2 and "error" not in row for row in rows), rows
    assert len({row["worker"] for row in rows}) == 2 and os.getpid() not in {row["worker"] for row in rows}
    result = warmup.summary(rows, wall, 2)
    total = sum(row["seconds"] for row in rows)
    assert result["families"] == {
        "stand-in": {"variants": 4, "sum_s": round(total, 3), "max_s": max(row["seconds"] for row in rows)}
    }
    assert result["speedup"] == round(round(total, 3) / wall, 2) and result["wall_s"] == round(wall, 3)


def test_a_failing_job_is_reported_and_the_others_run():
    rows, _ = warmup.run_jobs(["1", "x", "2"], int, 2)
    assert ["error" in row for row in rows] == [False, True, False]
    assert rows[1]["error"].startswith("ValueError")


@pytest.mark.parametrize(
    "seconds, jobs, expected", [([10, 2, 2, 2], 16, 10), ([1] * 32, 16, 2), ([3, 3], 1, 6), ([], 16, 0)]
)
def test_the_estimate_divides_the_sum_and_never_beats_the_longest(seconds, jobs, expected):
    assert warmup.estimated_wall(seconds, jobs) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("0", "--jobs must be at least 1 (one worker process), got 0"),
        ("-2", "--jobs must be at least 1 (one worker process), got -2"),
        ("two", "--jobs takes a whole number of processes, got 'two'"),
    ],
)
def test_jobs_below_one_are_refused(capsys, value, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["warmup", "--jobs", value])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("n_jobs, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_the_runner_refuses_a_count_that_is_not_a_positive_int(n_jobs, error):
    with pytest.raises(error, match="n_jobs must be"):
        warmup.run_jobs([], int, n_jobs)


# -- refusals and the real compile ---------------------------------------------------------------


def test_without_a_gpu_warmup_refuses_and_names_offline(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cli.main(["warmup", "--for", "verify", "--jobs", "2"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA or ROCm GPU" in err and "--offline sm90" in err


def test_offline_needs_the_compiler(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.main(["warmup", "--offline", "sm90"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err


def test_a_gpu_worker_makes_its_device_current_only_when_one_is_named(monkeypatch):
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(warmup, "_WORKER", {})
    warmup.init_worker(None, "cuda")  # the current device: nothing to change (set_device needs an index)
    warmup.init_worker(None, "cuda:1")
    assert made_current == [torch.device("cuda", 1)] and warmup._WORKER["device"] == torch.device("cuda", 1)


@pytest.mark.slow
def test_a_replayed_variant_is_the_kernel_the_real_launch_compiles(tmp_path):
    """Offline for sm90: a worker compiles the variants of one call (causal, GQA, ragged head dim,
    forward and backward) from tiny tensors; the real call afterwards, on its own tensors through
    the launchers, finds every kernel already compiled (Triton's in-memory cache does not grow) and
    compiles the same kernels (their hashes, Triton's on-disk cache keys)."""
    (row,) = compile_in_subprocess(f"""
        import json, os
        os.environ["TRITON_CACHE_DIR"] = {str(tmp_path)!r}
        import torch
        from flash_recipe.ops import offline
        from flash_recipe.tools import warmup, warmup_calls
        from flash_recipe.tools.verify import Case
        call = warmup_calls.dense_call("t", Case(1, 33, 47, 2, 1, 24, True), "float16")
        found, _ = warmup.variants([call], torch.device("cpu"), "sm90")
        warmup.init_worker("sm90", "cpu")
        for variant in found:
            warmup.compile_variant(variant)
        compiled = warmup._WORKER["compiled"]
        replayed = {{kernel.hash for _, kernel in compiled}}
        sizes = lambda: {{name: sum(len(c[0]) for c in fn.device_caches.values())
                         for name, fn in offline.jit_kernels().items()}}
        before, count = sizes(), len(compiled)
        with warmup.offline_planning("sm90"):
            call.make(torch.device("cpu"))
        real = {{kernel.hash for _, kernel in compiled[count:]}}
        print(json.dumps({{"variants": len(found), "before": before, "after": sizes(),
                          "same": real == replayed, "launches": len(compiled) - count}}))
    """)
    assert row["variants"] == 3 and row["launches"] == 3, row  # forward, preprocess, one-pass dK/dV + dQ
    assert row["after"] == row["before"] and row["same"], row


@pytest.mark.slow
def test_offline_warmup_compiles_in_two_processes_and_writes_its_report(tmp_path):
    """The command end to end, offline for sm90 (the forward and backward of the fp16 head-dim-16
    calls of ``--for common``): every variant compiles, in two worker processes, and the JSON
    report's families add up to its rows."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    report = tmp_path / "warmup.json"
    command = ["warmup", "--offline", "sm90", "--jobs", "2", "--for", "common", "--dtype", "float16"]
    command += ["--head-dim", "16", "--json", str(report)]
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "flash_recipe", *command], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(report.read_text())
    rows = result["rows"]
    assert result["target"] == "sm90" and result["jobs"] == 2 and result["errors"] == 0
    assert len(rows) == result["variants"] == sum(f["variants"] for f in result["families"].values()) > 0
    assert set(result["families"]) == {"fwd", "bwd"} and len({row["worker"] for row in rows}) <= 2
    assert result["sum_s"] == round(sum(row["seconds"] for row in rows), 3) and result["wall_s"] > 0
    assert "speed-up" in proc.stdout and "an estimate, not a measurement" in proc.stdout
