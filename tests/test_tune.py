"""``flash-recipe tune`` and the per-device cache of tuned configurations, on the CPU.

The cache (``flash_recipe.ops.tuned``) is tested as files: its format, where it lives, and that a
stale or corrupt file is ignored with one warning. The dispatcher's side (``choose.launch_config``,
``kvcache.auto_splits``) needs a GPU to ask; this machine has none, so ``fake_gpu`` stands in for
the missing driver alone: ``torch.cuda`` answers the device queries as an H100 would, and every
flash_recipe function runs unchanged. The tuner runs its real launches through Triton's
interpreter with timings injected (a timer function), and the pruning compiles real launches for
sm120 in a subprocess without the interpreter, as ``tests/test_compile.py`` does.
"""

from __future__ import annotations

import argparse
import json
import types
import warnings
from pathlib import Path

import pytest
import torch
from offline import compile_in_subprocess

from flash_recipe.ops import choose, configs, forward, kvcache, splits, targets, tuned
from flash_recipe.ops.configs import Config
from flash_recipe.tools import cli, tune
from flash_recipe.tools.tune.candidates import nearest

H100 = "NVIDIA H100 80GB HBM3"
CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch, tmp_path):
    """Every test has its own cache directory, an empty directory of shipped measured files, and
    starts with nothing read."""
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "tune-cache"))
    monkeypatch.setattr(tuned, "MEASURED_DIR", tmp_path / "measured")
    tuned.forget()
    yield
    tuned.forget()


@pytest.fixture
def fake_gpu(monkeypatch):
    """Only the missing GPU driver is mocked: ``torch.cuda`` reports device 0 as an H100 (sm90, 132
    multiprocessors, 227 KiB of shared memory per block) and device 1 as an A100 (sm80, 108,
    163 KiB), and the interpreter is switched off so that flash_recipe treats CUDA devices as
    GPUs. Nothing in flash_recipe is replaced."""
    gpus = {0: (H100, 9, 0, 132, 232448), 1: ("NVIDIA A100-SXM4-80GB", 8, 0, 108, 166912)}

    def index(device):
        return torch.device(device).index if not isinstance(device, int) else device

    def properties(device):
        name, major, minor, sms, shared = gpus[index(device)]
        return types.SimpleNamespace(
            name=name, major=major, minor=minor, multi_processor_count=sms, shared_memory_per_block_optin=shared
        )

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: properties(device).name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    targets.gpu_target.cache_clear()
    splits.sm_count.cache_clear()
    yield
    targets.gpu_target.cache_clear()
    splits.sm_count.cache_clear()


def _write(document, gpu=H100) -> str:
    path = tuned.cache_path(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


def _document(**changes) -> dict:
    """A valid file for the H100 with this process's Triton and flash_recipe: fwd d128 2-byte and
    one split-KV entry."""
    document = {
        "format": 1,
        "key": tuned.make_key(H100, "sm90"),
        "configs": [tuned.config_entry("fwd", 128, 2, (64, 32, 4, 5), ms={"x": 1.0})],
        "num_splits": [tuned.splits_entry(128, 2, 32, 8192, 5)],
    }
    document.update(changes)
    return document


def _tuned_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, tuned.TunedCacheWarning)]


# -- the cache file ---------------------------------------------------------------------------


def test_the_cache_lives_in_a_documented_directory_that_the_variable_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "mine"))
    assert tuned.cache_dir() == tmp_path / "mine"
    assert tuned.cache_path(H100) == tmp_path / "mine" / "NVIDIA-H100-80GB-HBM3.tune.json"
    assert tuned.file_name("AMD Instinct MI300X / gfx942:sramecc+") == "AMD-Instinct-MI300X-gfx942-sramecc.tune.json"
    monkeypatch.setenv(tuned.ENV_VAR, "")  # empty means unset
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuned.cache_dir() == tmp_path / "xdg" / "flash-recipe" / "tune"
    monkeypatch.delenv(tuned.ENV_VAR)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuned.cache_dir() == tmp_path / "home" / ".cache" / "flash-recipe" / "tune"


def test_the_cache_format_round_trips_and_a_new_run_keeps_the_other_entries():
    key = tuned.make_key(H100, "sm90")
    assert set(key) == {"gpu", "target", "triton", "flash_recipe"} and key["gpu"] == H100
    first = [
        tuned.config_entry("fwd", 128, 2, Config(128, 64, 8, 3), speedup=1.2),
        tuned.config_entry("decode", 64, 4, Config(16, 64, 4, 2)),
    ]
    path = tuned.save(key, first, [tuned.splits_entry(128, 2, 20, 5000, 8)])
    assert path == tuned.cache_path(H100) and path.exists()
    found = tuned.read(path)
    assert found.key == key
    assert found.configs == {("fwd", 128, 2): (128, 64, 8, 3), ("decode", 64, 4): (16, 64, 4, 2)}
    assert found.splits == {(128, 2, 32, 8192): 8}  # programs and cache length stored as their buckets
    assert found.document["configs"][0]["speedup"] == 1.2  # informational fields are kept
    # A second run replaces the entries it measured again and keeps the rest.
    tuned.save(key, [tuned.config_entry("fwd", 128, 2, Config(64, 64, 4, 2))], [tuned.splits_entry(64, 2, 8, 1024, 0)])
    found = tuned.read(path)
    assert found.configs == {("fwd", 128, 2): (64, 64, 4, 2), ("decode", 64, 4): (16, 64, 4, 2)}
    assert found.splits == {(128, 2, 32, 8192): 8, (64, 2, 8, 1024): 0}
    # A file keyed for another Triton is replaced, not merged.
    tuned.save({**key, "triton": "0.0.1"}, [tuned.config_entry("bwd_dq", 64, 2, Config(64, 32, 4, 1))], [])
    assert tuned.read(path).configs == {("bwd_dq", 64, 2): (64, 32, 4, 1)}
    # What the reader would refuse is never written.
    with pytest.raises(tuned.BadCacheFile, match="block_m must be one of"):
        tuned.save(key, [tuned.config_entry("fwd", 64, 2, Config(48, 64, 4, 2))], [])
    assert tuned.read(path).configs == {("bwd_dq", 64, 2): (64, 32, 4, 1)}
    assert [p.name for p in tuned.cache_files()] == ["NVIDIA-H100-80GB-HBM3.tune.json"]


def test_launch_config_takes_the_tuned_config_only_for_the_matching_device(fake_gpu, monkeypatch):
    _write(_document())
    table = configs.get_config("sm90", "fwd", 128, 2)
    assert table != Config(64, 32, 4, 5)
    assert choose.launch_config(CUDA0, "fwd", 100, 2) == Config(64, 32, 4, 5)  # same bucket
    assert choose.launch_config(torch.device("cuda"), "fwd", 128, 2) == Config(64, 32, 4, 5)  # current device
    assert choose.launch_config(CUDA0, "fwd", 128, 4) == configs.get_config("sm90", "fwd", 128, 4)
    assert choose.launch_config(CUDA0, "bwd_dq", 128, 2) == configs.get_config("sm90", "bwd_dq", 128, 2)
    assert choose.launch_config(CUDA0, "fwd", 64, 2) == configs.get_config("sm90", "fwd", 64, 2)
    # Another GPU model reads its own file (there is none): the table.
    assert choose.launch_config(torch.device("cuda", 1), "fwd", 128, 2) == configs.get_config("sm80", "fwd", 128, 2)
    # Never on the CPU.
    assert choose.launch_config(torch.device("cpu"), "fwd", 128, 2) == configs.get_config("interpreter", "fwd", 128, 2)
    # An overriding block comes first.
    with choose.overriding("fwd", 128, 2, Config(32, 32, 4, 1)):
        assert choose.launch_config(CUDA0, "fwd", 128, 2) == Config(32, 32, 4, 1)
    # Never under the interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose.launch_config(CUDA0, "fwd", 128, 2) == configs.get_config("interpreter", "fwd", 128, 2)


def test_a_tuned_config_that_fails_to_compile_falls_back_to_the_table(fake_gpu):
    """A launcher whose launch fails in Triton on a tuned configuration (here: out of shared memory,
    as a hand-edited entry gets on a real GPU) runs again on the table's, with one warning that
    names the entry; from then on the table serves that entry without another failure. Only the
    GPU is mocked (``fake_gpu``); the launcher stands in for a kernel launch."""
    from triton.runtime.errors import OutOfResources

    _write(_document())
    table = configs.get_config("sm90", "fwd", 128, 2)
    launched = []

    @choose.tuned_fallback
    def launcher(head_dim):
        cfg = choose.launch_config(CUDA0, "fwd", head_dim, 2)
        launched.append(cfg)
        if cfg == Config(64, 32, 4, 5):
            raise OutOfResources(300000, 232448, "shared memory")
        return cfg

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert launcher(128) == table
        assert launcher(128) == table
    assert launched == [Config(64, 32, 4, 5), table, table]
    (warning,) = _tuned_warnings(record)
    assert "fwd at head dim 128 (2-byte elements) on sm90" in str(warning.message)
    assert "OutOfResources" in str(warning.message) and "flash-recipe tune" in str(warning.message)
    tuned.forget()  # a new read of the files tries the entry again
    launched.clear()
    with pytest.warns(tuned.TunedCacheWarning):
        launcher(128)
    assert launched == [Config(64, 32, 4, 5), table]


def test_other_failures_of_a_launcher_propagate(fake_gpu):
    """An error that is not Triton's, or a Triton error on the table's configuration, propagates:
    the fallback only replaces a tuned configuration, and only once."""
    from triton.runtime.errors import OutOfResources

    _write(_document())

    @choose.tuned_fallback
    def bad_input(head_dim):
        choose.launch_config(CUDA0, "fwd", head_dim, 2)
        raise ValueError("q must be contiguous")

    @choose.tuned_fallback
    def always_out_of_memory(head_dim):
        choose.launch_config(CUDA0, "fwd", head_dim, 2)
        raise OutOfResources(300000, 232448, "shared memory")

    with pytest.raises(ValueError, match="contiguous"):
        bad_input(128)
    with pytest.raises(OutOfResources), pytest.warns(tuned.TunedCacheWarning):
        always_out_of_memory(128)  # tuned, then the table's: the second failure is the caller's
    with pytest.raises(OutOfResources):
        always_out_of_memory(64)  # no tuned entry at head dim 64: nothing to fall back from


def test_a_machine_without_a_cache_file_runs_the_table(fake_gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning
        for kernel in configs.KERNELS:
            for head_dim in (16, 64, 128, 256):
                for size in (2, 4):
                    assert choose.launch_config(CUDA0, kernel, head_dim, size) == configs.get_config(
                        "sm90", kernel, head_dim, size
                    )
        step = (1, 4, 1, 4096, CUDA0, 128, 2)  # batch, heads, rows, capacity, device, head dim, element size
        assert kvcache.auto_splits(*step) == kvcache.heuristic_splits(*step)


def test_the_file_is_read_once_per_process_and_again_when_the_variable_changes(fake_gpu, monkeypatch, tmp_path):
    _write(_document())
    reads = []
    read = tuned.read
    monkeypatch.setattr(tuned, "read", lambda path: reads.append(path) or read(path))
    for _ in range(50):
        assert choose.launch_config(CUDA0, "fwd", 128, 2) == Config(64, 32, 4, 5)
        kvcache.auto_splits(2, 16, 1, 8192, CUDA0, 128, 2)
    assert reads == [tuned.MEASURED_DIR / "NVIDIA-H100-80GB-HBM3.tune.json", tuned.cache_path(H100)]  # one each
    other = tmp_path / "other"
    monkeypatch.setenv(tuned.ENV_VAR, str(other))
    tuned.save(tuned.make_key(H100, "sm90"), [tuned.config_entry("fwd", 128, 2, (128, 128, 8, 2))], [])
    assert choose.launch_config(CUDA0, "fwd", 128, 2) == Config(128, 128, 8, 2)
    assert reads[-1] == other / "NVIDIA-H100-80GB-HBM3.tune.json"


@pytest.mark.parametrize(
    "field, value",
    [("gpu", "NVIDIA A100-SXM4-80GB"), ("target", "sm80"), ("triton", "2.0.0"), ("flash_recipe", "0.0.1")],
)
def test_a_stale_file_is_ignored_with_one_warning(fake_gpu, field, value):
    path = _write(_document(key={**tuned.make_key(H100, "sm90"), field: value}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert choose.launch_config(CUDA0, "fwd", 128, 2) == configs.get_config("sm90", "fwd", 128, 2)
            step = (2, 16, 1, 8192, CUDA0, 128, 2)
            assert kvcache.auto_splits(*step) == kvcache.heuristic_splits(*step)
    (warning,) = _tuned_warnings(record)
    message = str(warning.message)
    assert path in message and f"{field} {value!r}" in message and "flash-recipe tune" in message


CORRUPT = {
    "truncated": '{"format": 1, "key": {',
    "not-an-object": "[1, 2]",
    "other-format": _document(format=2),
    "key-missing-a-field": _document(key={"gpu": H100, "target": "sm90", "triton": "x"}),
    "block-not-a-power-of-two": _document(configs=[tuned.config_entry("fwd", 128, 2, (48, 64, 4, 2))]),
    "stages-a-string": _document(configs=[tuned.config_entry("fwd", 128, 2, (64, 64, 4, "3"))]),
    "head-dim-not-a-bucket": _document(configs=[tuned.config_entry("fwd", 96, 2, (64, 64, 4, 2))]),
    "duplicate-entry": _document(configs=[tuned.config_entry("fwd", 128, 2, (64, 64, 4, 2))] * 2),
    "splits-too-many": _document(num_splits=[tuned.splits_entry(128, 2, 32, 8192, 1000)]),
    "programs-not-a-bucket": _document(num_splits=[{**tuned.splits_entry(128, 2, 32, 8192, 4), "programs": 20}]),
    "nested-too-deep": "[" * 100_000 + "]" * 100_000,  # json raises RecursionError, not ValueError
}


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_a_corrupt_file_is_ignored_with_one_warning(fake_gpu, name):
    path = _write(CORRUPT[name])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert choose.launch_config(CUDA0, "fwd", 128, 2) == configs.get_config("sm90", "fwd", 128, 2)
    (warning,) = _tuned_warnings(record)
    assert path in str(warning.message) and "built-in table" in str(warning.message)
    with pytest.raises(tuned.BadCacheFile):
        tuned.read(path)


def test_an_entry_that_cannot_fit_the_gpu_is_dropped_with_one_warning_and_the_rest_used(fake_gpu):
    huge = tuned.config_entry("bwd_dq", 128, 2, (256, 256, 16, 8))  # 7 stages of 256x128 tiles: 448 KiB
    path = _write(_document(configs=_document()["configs"] + [huge]))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert choose.launch_config(CUDA0, "bwd_dq", 128, 2) == configs.get_config("sm90", "bwd_dq", 128, 2)
            assert choose.launch_config(CUDA0, "fwd", 128, 2) == Config(64, 32, 4, 5)  # the fitting entry
    (warning,) = _tuned_warnings(record)
    message = str(warning.message)
    assert path in message and "bwd_dq" in message and "458752" in message and "232448" in message


def test_the_shared_memory_floor_keeps_every_table_configuration():
    """The floor is a lower bound: no configuration of the table (which the compile check proves
    fits) is above its targets' limits."""
    for (family, kernel), rows in configs._TABLE.items():
        targets = [t for t, f in configs.FAMILIES.items() if f == family]
        for max_bucket, size, config in rows:
            for target in targets:
                floor = tuned.shared_memory_floor(config, max_bucket, size)
                assert floor <= configs.SHARED_MEMORY_LIMIT[target], (family, kernel, config, target)


_SAVER = """
import sys
from flash_recipe.ops import tuned
key = {"gpu": "Race GPU", "target": "sm90", "triton": "t", "flash_recipe": "f"}
offset = int(sys.argv[1])
for i in range(int(sys.argv[2])):
    tuned.save(key, [], [tuned.splits_entry(64, 2, 2 ** (i % 20), 2 ** (offset + i // 20), 1)])
"""


def test_two_processes_saving_at_once_keep_every_entry(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, tuned.ENV_VAR: str(tmp_path / "race")}
    saves = 150
    procs = [
        subprocess.Popen([sys.executable, "-c", _SAVER, str(offset), str(saves)], env=env, stderr=subprocess.PIPE)
        for offset in (0, 20)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
    found = tuned.read(tmp_path / "race" / tuned.file_name("Race GPU"))
    assert len(found.splits) == 2 * saves


def test_auto_splits_takes_the_tuned_count_for_its_bucket_else_the_heuristic(fake_gpu):
    _write(_document(num_splits=[tuned.splits_entry(128, 2, 32, 8192, 5), tuned.splits_entry(128, 2, 64, 8192, 0)]))
    # 2 x 16 programs (bucket 32), capacity 5000 (bucket 8192): the tuned count.
    assert kvcache.auto_splits(2, 16, 1, 5000, CUDA0, 128, 2) == 5
    assert kvcache.auto_splits(2, 16, 1, 5000, CUDA0, 100, 2) == 5  # head dim 100 is bucket 128
    assert kvcache.auto_splits(2, 16, 16, 5000, CUDA0, 128, 2) == 5  # a decoding step of 16 query rows
    # 17 query rows run the forward kernel, which was not tuned for it: the heuristic.
    step = (1, 16, 17, 5000, CUDA0, 128, 2)
    assert kvcache.auto_splits(*step) == kvcache.heuristic_splits(*step)
    heuristic = kvcache.heuristic_splits(2, 16, 1, 5000, CUDA0, 128, 2)
    assert heuristic != 5
    for other in [(2, 16, 1, 9000, CUDA0, 128, 2), (2, 16, 1, 5000, CUDA0, 128, 4), (2, 16, 1, 5000, CUDA0, 64, 2)]:
        assert kvcache.auto_splits(*other) == kvcache.heuristic_splits(*other)  # no entry: the heuristic
    step = (4, 16, 1, 5000, CUDA0, 128, 2)
    assert kvcache.auto_splits(*step) == kvcache.heuristic_splits(*step)  # 0
    assert kvcache.auto_splits(2, 16, 1, 5000, torch.device("cpu"), 128, 2) == 1


# -- the tuner --------------------------------------------------------------------------------

# Check shapes small enough for the interpreter: a multiple of every block and a ragged pair.
SMALL = tune.CheckSizes(batch=2, nheads=2, nheads_k=1, seqlens=((32, 32), (13, 29)), cache_len=40)
# A tuning run on the CPU's interpreter at the least size: checked on SMALL, timed on 32 tokens of 2
# heads, causal only.
TINY = dict(device="cpu", check=SMALL, nheads=2, tokens=32, causal=(True,))


def test_candidates_start_with_the_table_and_respect_each_kernel():
    for kernel in configs.KERNELS:
        table = configs.get_config("sm90", kernel, 128, 2)
        found = tune.candidates(kernel, table)
        assert found[0] == table and len(found) == len(set(found)) > 10
        for c in found[1:]:
            assert {c.block_m, c.block_n} <= {16, 32, 64, 128, 256} and c.num_warps in (4, 8)
            assert 1 <= c.num_stages <= 4
            assert c.num_warps == 4 or c.block_m * c.block_n >= tune.EIGHT_WARPS_MIN_TILE
            assert kernel != "decode" or c.block_m == 16
    assert tune.candidates("fwd", Config(32, 32, 1, 1), {"fwd": [(16, 16, 1, 1), (32, 32, 1, 1)]}) == [
        Config(32, 32, 1, 1),
        Config(16, 16, 1, 1),
    ]


@pytest.fixture
def launches(monkeypatch):
    """Record the configuration of every forward launch (as the launcher asks for it), and make
    the ``WRONG`` configuration's output wrong by 0.01 and the ``BROKEN`` one's launch fail."""
    seen = []
    launch = forward.attention_forward

    def recorded(q, k, v, options, *args, **kwargs):
        config = choose.launch_config(q.device, kwargs.get("kernel", "fwd"), q.shape[-1], q.element_size())
        seen.append(config)
        if config == BROKEN:
            raise RuntimeError("out of resources: shared memory")
        out, lse = launch(q, k, v, options, *args, **kwargs)
        return (out + 0.01 if config == WRONG else out), lse

    monkeypatch.setattr(forward, "attention_forward", recorded)
    return seen


WRONG, BROKEN, FAST, SLOW = Config(16, 32, 1, 1), Config(32, 16, 1, 2), Config(16, 16, 1, 1), Config(32, 16, 1, 1)


def test_the_tuner_keeps_the_fastest_correct_candidate(launches, fake_gpu, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tuner's launches run on the CPU, in the interpreter
    table = configs.get_config("interpreter", "fwd", 32, 2)
    speed = {table: 1.0, FAST: 0.6, SLOW: 0.9, WRONG: 0.1, BROKEN: 0.1}
    timed = []

    def timer(fn, trial):
        before = len(launches)
        fn()
        assert launches[before:] == [trial.config]  # the timed launch ran the candidate, through the launcher
        timed.append(trial)
        return speed[trial.config] * trial.shape.seqlen_k / 32

    lines = []
    report = tune.tune(
        ["fwd"],
        [32],
        ["float16"],
        [32, 64],
        device="cpu",
        timer=timer,
        check=SMALL,
        nheads=2,
        tokens=64,
        grid={"fwd": [FAST, SLOW, WRONG, BROKEN]},
        key=tuned.make_key(H100, "sm90"),
        progress=lines.append,
    )
    status = {tuple(t["config"]): t["status"] for t in report["trials"]}
    assert status == {table: "ok", FAST: "ok", SLOW: "ok", WRONG: "wrong", BROKEN: "error"}
    wrong = next(t for t in report["trials"] if tuple(t["config"]) == WRONG)
    assert "out error" in wrong["detail"] and not wrong["ms"]
    assert {t.config for t in timed} == {table, FAST, SLOW}  # a wrong candidate is never timed
    # Two lengths x causal and not, per timed candidate.
    assert {t.shape.id for t in timed} == {
        "B2-H2-Hk2-D32-Sq32-Sk32-full",
        "B2-H2-Hk2-D32-Sq32-Sk32-causal",
        "B1-H2-Hk2-D32-Sq64-Sk64-full",
        "B1-H2-Hk2-D32-Sq64-Sk64-causal",
    }
    (entry,) = report["configs"]
    assert (entry["kernel"], entry["head_dim"], entry["element_size"]) == ("fwd", 32, 2)
    assert Config(entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"]) == FAST
    assert entry["speedup"] == pytest.approx(1 / 0.6, abs=1e-4) and entry["table"] == list(table)
    assert any("16x16 w1 s1, 1.667x the table's speed" in line for line in lines)
    # Written to the H100's file, which the launches on that GPU then use.
    assert report["path"] == str(tuned.cache_path(H100))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert choose.launch_config(CUDA0, "fwd", 32, 2) == FAST
    assert choose.launch_config(CUDA0, "fwd", 32, 4) == configs.get_config("sm90", "fwd", 32, 4)


def test_the_table_stays_unless_a_candidate_beats_it_by_min_gain():
    table = configs.get_config("interpreter", "fwd", 32, 4)
    report = tune.tune(
        ["fwd"],
        [32],
        ["float32"],
        [32],
        device="cpu",
        timer=lambda fn, trial: 0.99 if trial.config == FAST else 1.0,
        check=SMALL,
        nheads=2,
        causal=(True,),
        grid={"fwd": [FAST]},
        save=False,
    )
    (entry,) = report["configs"]
    assert Config(entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"]) == table
    assert entry["speedup"] == 1.0 and report["path"] is None


def test_the_tuner_times_the_split_kv_counts_of_a_decoding_step():
    """Cache length 128 over 32-key blocks: 1, 2 and 4 splits are worth timing, 8 is not."""
    table = configs.get_config("interpreter", "decode", 32, 4)
    speed = {1: 1.0, 2: 0.7, 4: 0.5}
    timed = []

    def timer(fn, trial):
        fn()
        timed.append(trial)
        return speed[trial.num_splits] if trial.num_splits else 1.0

    report = tune.tune(
        ["decode"],
        [32],
        ["float32"],
        [128],
        device="cpu",
        timer=timer,
        check=SMALL,
        nheads=4,
        decode_batches=(1, 3),
        splits=(1, 2, 4, 8),
        grid={"decode": []},
        save=False,
    )
    assert {(t.config, t.num_splits) for t in timed if t.num_splits != 1} == {(table, 2), (table, 4)}
    entries = {(e["programs"], e["cache_len"]): e["num_splits"] for e in report["num_splits"]}
    # 4 query heads over 1 kv head pack into one program per batch entry (ops.kvcache.program_heads):
    # 1 x 1 and 3 x 1 programs, bucketed to powers of two
    assert entries == {(1, 128): 4, (4, 128): 4}


def test_the_tuner_drops_the_candidates_pruning_drops(monkeypatch):
    """The wiring: on a target with a shared-memory limit, ``prune`` runs before any launch and what
    it drops is never checked or timed (the compile itself is tested below, in a subprocess)."""
    monkeypatch.setattr(targets, "target_of", lambda device: "sm120")
    table = configs.get_config("sm120", "fwd", 32, 4)

    def fake_prune(kernel, head_dim, dtype, found, target, jobs=1):
        assert (kernel, head_dim, dtype, target) == ("fwd", 32, "float32", "sm120")
        rows = [{"config": list(c), "form": "aligned", "fits": c != SLOW, "problem": "needs 200000 B"} for c in found]
        return [c for c in found if c != SLOW], rows

    monkeypatch.setattr(tune.search, "prune", fake_prune)
    timed = set()
    report = tune.tune(
        ["fwd"],
        [32],
        ["float32"],
        [32],
        device="cpu",
        timer=lambda fn, trial: timed.add(trial.config) or 1.0,
        check=SMALL,
        nheads=2,
        causal=(True,),
        grid={"fwd": [FAST, SLOW]},
        save=False,
    )
    assert timed == {table, FAST}
    assert {tuple(t["config"]): t["status"] for t in report["trials"]} == {table: "ok", FAST: "ok", SLOW: "pruned"}
    assert next(t["detail"] for t in report["trials"] if t["status"] == "pruned") == "needs 200000 B"


def test_tune_refuses_without_a_gpu_or_a_timer():
    with pytest.raises(tune.TuneError, match="times the kernels on a GPU"):
        tune.tune(["fwd"], [64], device="cpu")
    with pytest.raises(tune.TuneError, match="keyed by the GPU"):
        tune.tune(["fwd"], [64], device="cpu", timer=lambda fn, trial: 1.0)
    with pytest.raises(ValueError, match="head_dims must be a non-empty selection of 16, 32, 64, 128, 256, got 96"):
        tune.tune(["fwd"], [96], device="cpu", timer=lambda fn, trial: 1.0, save=False)


@pytest.mark.slow
def test_pruning_drops_an_oversized_candidate_and_keeps_a_fitting_one():
    """Compiled for sm120 (99 KiB per block) as a launch compiles it: a 128x128, 3-stage forward at
    head dim 256 needs far more shared memory and is dropped without its ragged form being
    compiled; a 64x32 single-stage one in 8 warps fits both forms, without a spill, and is kept."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.tools import tune
        from flash_recipe.ops.configs import Config
        kept, rows = tune.prune("fwd", 256, "bfloat16", [Config(128, 128, 8, 3), Config(64, 32, 8, 1)], "sm120")
        print(json.dumps({"kept": kept}))
        for row in rows:
            print(json.dumps(row))
    """)
    assert rows.pop(0)["kept"] == [[64, 32, 8, 1]]
    by = {(tuple(row["config"]), row["form"]): row for row in rows}
    assert set(by) == {((128, 128, 8, 3), "aligned"), ((64, 32, 8, 1), "aligned"), ((64, 32, 8, 1), "ragged")}
    oversized = by[(128, 128, 8, 3), "aligned"]
    assert not oversized["fits"] and oversized["shared_bytes"] > oversized["shared_limit"] == 101376
    assert "sm120 offers 101376 B" in oversized["problem"]
    for form in ("aligned", "ragged"):
        fitting = by[(64, 32, 8, 1), form]
        assert fitting["fits"] and 0 < fitting["shared_bytes"] <= 101376 and fitting["problem"] is None


@pytest.mark.slow
def test_pruning_drops_a_candidate_that_spills_in_the_aligned_form_only():
    """Compiled for sm80 as a launch compiles it, the head-dim-32 forward's 128x64 tile fits in 8
    warps at 2 stages; a third stage needs more registers than 8 warps have, and the aligned form's
    code spills (``compile_calls.resource_usage``): dropped, with its registers and spilled bytes.
    At head dim 64, 128x64 in 4 warps spills only in the ragged form (every score option at once):
    reported there, and kept."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.tools import tune
        from flash_recipe.ops.configs import Config
        kept, rows = tune.prune("fwd", 32, "float16", [Config(128, 64, 8, 2), Config(128, 64, 8, 3)], "sm80")
        print(json.dumps({"kept": kept}))
        for row in rows:
            print(json.dumps(row))
        kept, rows = tune.prune("fwd", 64, "float16", [Config(128, 64, 4, 2)], "sm80")
        print(json.dumps({"kept": kept}))
        for row in rows:
            print(json.dumps({**row, "head_dim": 64}))
    """)
    assert rows.pop(0)["kept"] == [[128, 64, 8, 2]]
    assert {"kept": [[128, 64, 4, 2]]} in rows
    by = {(tuple(row["config"]), row["form"], row.get("head_dim", 32)): row for row in rows if "config" in row}
    spilling = by[(128, 64, 8, 3), "aligned", 32]
    assert not spilling["fits"] and spilling["spill_bytes"] > 0 and spilling["registers"] > 0
    assert spilling["problem"] == f"spills {spilling['spill_bytes']} B per thread ({spilling['registers']} registers)"
    assert ((128, 64, 8, 3), "ragged", 32) not in by  # dropped in one form, not compiled in the next
    for form in ("aligned", "ragged"):
        fitting = by[(128, 64, 8, 2), form, 32]
        assert fitting["fits"] and fitting["spill_bytes"] == 0 and fitting["problem"] is None
    ragged = by[(128, 64, 4, 2), "ragged", 64]
    assert ragged["fits"] and ragged["spill_bytes"] > 0 and ragged["problem"] is None
    assert by[(128, 64, 4, 2), "aligned", 64]["spill_bytes"] == 0


@pytest.mark.slow
def test_pruning_keeps_a_candidate_whose_spills_cannot_be_read():
    """Without the tool that reads a cubin's registers (a Triton shipping no ``cuobjdump``), the
    spilling tile above is kept on its other checks, its registers and spills unknown."""
    rows = compile_in_subprocess("""
        import json
        from flash_recipe.tools import compile_calls, tune
        from flash_recipe.ops.configs import Config

        def missing(kernel, amd):
            raise FileNotFoundError("cuobjdump")

        compile_calls.resource_usage = missing
        kept, rows = tune.prune("fwd", 32, "float16", [Config(128, 64, 8, 3)], "sm80", forms=("aligned",))
        print(json.dumps({"kept": kept}))
        for row in rows:
            print(json.dumps(row))
    """)
    assert rows.pop(0)["kept"] == [[128, 64, 8, 3]]
    (row,) = rows
    assert row["fits"] and row["registers"] is None and row["spill_bytes"] is None and row["problem"] is None


# -- the command line -------------------------------------------------------------------------


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="flash-recipe tune")
    tune.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_tune_is_a_subcommand_and_parses_its_options():
    assert cli.SUBCOMMANDS["tune"][0] == ".tune"
    args = _parse()
    assert (args.kernel, args.head_dim, args.dtype, args.seqlen) == (
        [*configs.KERNELS, configs.ONE_LAUNCH],
        [64, 128],
        ["bfloat16"],
        [1024, 4096],
    )
    args = _parse(
        "--kernel",
        "fwd,decode",
        "--head-dim",
        "128,256",
        "--dtype",
        "float16,float32",
        "--seqlen",
        "2048",
        "--causal",
        "yes",
        "--splits",
        "1,4",
        "--min-gain",
        "0.05",
        "--jobs",
        "3",
        "--no-save",
    )
    assert (args.kernel, args.head_dim, args.dtype, args.seqlen) == (
        ["fwd", "decode"],
        [128, 256],
        ["float16", "float32"],
        [2048],
    )
    assert (args.causal, args.splits, args.min_gain, args.jobs, args.no_save) == ("yes", [1, 4], 0.05, 3, True)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--head-dim", "96"], ["--head-dim", "16,32,64,128,256", "'96'"]),
        (["--dtype", "float8"], ["--dtype", "float16,bfloat16,float32", "'float8'"]),
        (["--kernel", "forward"], ["--kernel", ",".join(configs.KERNELS), "'forward'"]),
        (["--seqlen", "0"], ["--seqlen", "integers >= 1", "'0'"]),
        (["--splits", "3"], ["--splits", "1,2,4,8,16,32,64", "'3'"]),
        (["--causal", "maybe"], ["--causal", "both", "yes", "no", "'maybe'"]),
        (["--min-gain", "1.5"], ["--min-gain", "[0, 1)", "'1.5'"]),
        (["--jobs", "0"], ["--jobs", "positive integer", "'0'"]),
    ],
)
def test_bad_options_are_named_with_their_allowed_values(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU gets")
def test_tune_refuses_on_a_machine_without_a_gpu(capsys):
    assert cli.main(["tune", "--kernel", "fwd"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA or ROCm GPU is visible" in err and "tune --show" in err
    assert not tuned.cache_files()


def test_show_and_clear_work_without_a_gpu(capsys):
    assert cli.main(["tune", "--show"]) == 0
    assert "no files" in capsys.readouterr().out
    tuned.save(
        tuned.make_key(H100, "sm90"),
        [tuned.config_entry("fwd", 128, 2, (128, 64, 8, 3))],
        [tuned.splits_entry(128, 2, 32, 8192, 4)],
        paths=[tuned.path_entry(64, 2, "three_kernels")],
    )
    _write("not json", gpu="Other GPU")
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert str(tuned.cache_dir()) in out and tuned.ENV_VAR in out
    assert f"{H100} (sm90)" in out and "fwd      d128 2-byte  128x64 w8 s3" in out
    assert "32 programs, cache 8192: 4" in out and "Other-GPU.tune.json: ignored, is not valid JSON" in out
    assert "backward d64  2-byte  three_kernels" in out
    assert f"measured defaults shipped: {tuned.MEASURED_DIR}; no files" in out
    assert cli.main(["tune", "--clear"]) == 0
    assert out.count("deleted") == 0 and capsys.readouterr().out.count("deleted") == 2
    assert tuned.cache_files() == []
    _ship(_measured())  # shown, and never deleted by --clear: it is the wheel's
    assert cli.main(["tune", "--clear"]) == 0 and cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert "no tuned configurations" in out and f"measured defaults shipped: {tuned.MEASURED_DIR}\n" in out
    assert "Triton 3.6.0, flash_recipe 0.0.1" in out and "fwd      d128 2-byte  128x32 w8 s2" in out


@pytest.mark.parametrize("device", ["cpu", "cuda:5", "gpu0"])
def test_a_device_that_is_not_a_visible_gpu_is_refused_by_name(device, fake_gpu, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli.main(["tune", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "--device must be a GPU, cuda or cuda:N with N < 2" in err and repr(device) in err


# -- the backward's path ----------------------------------------------------------------------


def test_the_backward_path_section_round_trips_and_refuses_a_path_it_does_not_know():
    key = tuned.make_key(H100, "sm90")
    path = tuned.save(key, [], [], paths=[tuned.path_entry(128, 2, "three_kernels", speedup=1.1)])
    assert tuned.read(path).paths == {(128, 2): "three_kernels"}
    tuned.save(key, [], [], paths=[tuned.path_entry(64, 2, "one_pass")])  # merged with the first
    assert tuned.read(path).paths == {(128, 2): "three_kernels", (64, 2): "one_pass"}
    for entry, words in (
        (tuned.path_entry(128, 2, "two_pass"), "path is one of one_pass, three_kernels"),
        (tuned.path_entry(96, 2, "one_pass"), "head_dim must be one of"),
    ):
        with pytest.raises(tuned.BadCacheFile, match=words):
            tuned.parse(_document(backward=[entry]))
    with pytest.raises(tuned.BadCacheFile, match="a second entry for head dim 128"):
        tuned.parse(_document(backward=[tuned.path_entry(128, 2, "one_pass")] * 2))
    assert tuned.parse(_document()).paths == {}  # the section is optional: older files stay valid


def test_the_backward_path_is_the_blocks_then_the_tuned_then_the_familys(fake_gpu, monkeypatch):
    """``choose.backward_path``: a ``taking_path`` block, else a tuned entry for this GPU model,
    else ``configs.BACKWARD_PATHS``, whose one pass needs a Triton that compiles its tile cleanly."""
    default = configs.backward_path("sm90", 64)
    other = next(p for p in ("one_pass", "three_kernels") if p != default)
    assert choose.backward_path(CUDA0, 64, 2) == default
    _write(_document(backward=[tuned.path_entry(64, 2, other)]))
    tuned.forget()
    assert choose.backward_path(CUDA0, 64, 2) == other  # the GPU's measurement wins
    assert choose.backward_path(CUDA0, 64, 4) == default  # for its element size only
    with choose.taking_path(default):
        assert choose.backward_path(CUDA0, 64, 2) == default
        assert choose.plan_state() is None  # plans are not memoized inside the block
    with pytest.raises(ValueError, match="path must be one of"), choose.taking_path("fast"):
        pass
    monkeypatch.setitem(configs.BACKWARD_PATHS, "sm80", {**configs.BACKWARD_PATHS["sm80"], 128: "one_pass"})
    monkeypatch.setattr(choose, "one_pass_fits", lambda device, head_dim: False)
    assert choose.backward_path(torch.device("cuda", 1), 128, 2) == "three_kernels"  # A100: no tuned file


def test_the_tuner_keeps_the_faster_backward_path_and_launches_then_take_it(fake_gpu, monkeypatch):
    """Every path (the one launch too, which the interpreter's table offers) is checked, then timed
    as the whole backward; another path replaces the family's default when it is at least
    ``min_gain`` faster."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    default = configs.backward_path("interpreter", 32)
    other = next(p for p in ("one_pass", "three_kernels") if p != default)
    from flash_recipe.ops import backward, backward_one_launch

    ran = []
    original = backward.attn_bwd_dkdv_kernel.fn.run
    original_one_launch = backward_one_launch.attn_bwd_one_launch_kernel.fn.run

    def run(*args, **kwargs):
        ran.append("one_pass" if kwargs.get("ATOMIC_DQ") else "three_kernels")
        return original(*args, **kwargs)

    def run_one_launch(*args, **kwargs):
        ran.append("one_launch")
        return original_one_launch(*args, **kwargs)

    monkeypatch.setattr(backward.attn_bwd_dkdv_kernel.fn, "run", run)
    monkeypatch.setattr(backward_one_launch.attn_bwd_one_launch_kernel.fn, "run", run_one_launch)
    timed = set()

    def timer(fn, trial):
        before = len(ran)
        fn()
        if trial.path is None:  # the dQ kernel's own configuration, tuned first
            return 1.0
        assert ran[before:] == [trial.path]  # the timed launch ran the path it names
        timed.add(trial.path)
        return 0.5 if trial.path == other else 1.0

    report = tune.tune(
        ["bwd_dq"], [32], ["float16"], [32], timer=timer, grid={"bwd_dq": []}, key=tuned.make_key(H100, "sm90"), **TINY
    )
    (entry,) = report["backward"]
    assert timed == {"one_pass", "three_kernels", "one_launch"}
    assert (entry["head_dim"], entry["element_size"], entry["path"], entry["default"]) == (32, 2, other, default)
    assert entry["speedup"] == pytest.approx(2.0)
    assert tuned.read(report["path"]).paths == {(32, 2): other}
    monkeypatch.delenv("TRITON_INTERPRET")
    assert choose.backward_path(CUDA0, 32, 2) == other


# -- the measured defaults shipped in the wheel -----------------------------------------------


def _ship(document, gpu=H100) -> str:
    """Put ``document`` where the wheel's measured file for ``gpu`` lies (``tuned.MEASURED_DIR``,
    an empty directory of this test's: ``_fresh_cache``)."""
    path = tuned.MEASURED_DIR / tuned.file_name(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


def _measured(**changes) -> dict:
    """A shipped file for the H100, measured under another Triton and flash_recipe than this
    process's: the forward at d128 2-byte, the backward at d64 on the path the family does not run."""
    other = next(p for p in ("one_pass", "three_kernels") if p != configs.backward_path("sm90", 64))
    fields = dict(
        key={**tuned.make_key(H100, "sm90"), "triton": "3.6.0", "flash_recipe": "0.0.1"},
        configs=[tuned.config_entry("fwd", 128, 2, (128, 32, 8, 2))],
        backward=[tuned.path_entry(64, 2, other, source="campaign shoot-out")],
    )
    return _document(**{**fields, **changes})


def test_a_shipped_measured_file_changes_the_defaults_and_the_users_file_overrides_it_entry_by_entry(fake_gpu):
    """The shipped file applies under any Triton (its key's ``triton`` is 3.6.0, this process's is
    not) to the GPU model it names; the user's ``flash-recipe tune`` file wins where both have an
    entry, and the shipped file's other entries still apply."""
    default_path = configs.backward_path("sm90", 64)
    shipped = _measured()
    measured_path = shipped["backward"][0]["path"]
    assert choose.launch_config(CUDA0, "fwd", 128, 2) == configs.get_config("sm90", "fwd", 128, 2)
    _ship(shipped)
    tuned.forget()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert choose.launch_config(CUDA0, "fwd", 128, 2) == Config(128, 32, 8, 2)
        assert choose.backward_path(CUDA0, 64, 2) == measured_path != default_path
        assert choose.launch_config(CUDA0, "fwd", 64, 2) == configs.get_config("sm90", "fwd", 64, 2)  # not in it
        assert choose.launch_config(torch.device("cuda", 1), "fwd", 128, 2) == configs.get_config(
            "sm80", "fwd", 128, 2
        )  # the A100 has no file
    assert not _tuned_warnings(record)
    _write(_document())  # the user's: fwd d128 2-byte (64, 32, 4, 5), no backward entry
    tuned.forget()
    assert choose.launch_config(CUDA0, "fwd", 128, 2) == Config(64, 32, 4, 5)  # the user's entry wins
    assert choose.backward_path(CUDA0, 64, 2) == measured_path  # the shipped one stays where the user has none
    _write(_document(backward=[tuned.path_entry(64, 2, default_path)]))
    tuned.forget()
    assert choose.backward_path(CUDA0, 64, 2) == default_path
    assert choose.backward_path(CUDA0, 64, 2) != measured_path


@pytest.mark.parametrize(
    "name, document, words",
    [
        ("another-gpu", _measured(key={**tuned.make_key(H100, "sm90"), "gpu": "NVIDIA H200"}), "gpu 'NVIDIA H200'"),
        ("another-target", _measured(key={**tuned.make_key(H100, "sm90"), "target": "sm100"}), "target 'sm100'"),
        ("corrupt", '{"format": 1, "key": {', "not valid JSON"),
    ],
)
def test_a_shipped_file_for_another_gpu_or_unreadable_is_ignored_with_one_warning(fake_gpu, name, document, words):
    path = _ship(document)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert choose.launch_config(CUDA0, "fwd", 128, 2) == configs.get_config("sm90", "fwd", 128, 2)
            assert choose.backward_path(CUDA0, 64, 2) == configs.backward_path("sm90", 64)
    (warning,) = _tuned_warnings(record)
    message = str(warning.message)
    assert path in message and words in message and "measured defaults shipped" in message


def test_an_unfit_shipped_entry_is_dropped_with_one_warning_and_the_rest_used(fake_gpu, monkeypatch):
    """An entry that cannot fit this GPU's shared memory, and a one-pass entry under a Triton that
    does not compile the one-pass tile cleanly (``configs.ONE_PASS_TRITON``: sm90 at 128 spills
    under 3.6), are dropped with one warning; the file's other entries apply."""
    from flash_recipe.ops import targets as targets_module

    huge = tuned.config_entry("bwd_dq", 128, 2, (256, 256, 16, 8))  # 448 KiB: more than the H100's 227
    one_pass = tuned.path_entry(128, 2, "one_pass")
    shipped = _measured()
    _ship({**shipped, "configs": shipped["configs"] + [huge], "backward": shipped["backward"] + [one_pass]})
    monkeypatch.setattr(targets_module, "triton_release", lambda: (3, 6))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert choose.launch_config(CUDA0, "bwd_dq", 128, 2) == configs.get_config("sm90", "bwd_dq", 128, 2)
            assert choose.backward_path(CUDA0, 128, 2) == "three_kernels"
            assert choose.launch_config(CUDA0, "fwd", 128, 2) == Config(128, 32, 8, 2)  # the fitting entry
            assert choose.backward_path(CUDA0, 64, 2) == shipped["backward"][0]["path"]
    (warning,) = _tuned_warnings(record)
    message = str(warning.message)
    assert "2 entries" in message and "458752" in message and "Triton 3.6" in message
    monkeypatch.setattr(targets_module, "triton_release", lambda: (3, 9))  # compiles the tile cleanly
    tuned.forget()
    assert choose.backward_path(CUDA0, 128, 2) == "one_pass"


def test_the_wheels_measured_files_are_valid_and_each_names_the_gpu_of_its_file_name():
    """Every file shipped in ``flash_recipe/measured/`` parses, is named for the GPU its key gives,
    and fits that GPU's family's shared memory (the campaign writes them; a person commits them)."""
    directory = Path(tuned.__file__).resolve().parent.parent / "measured"
    assert (directory / "README.md").is_file()
    for path in sorted(directory.glob("*" + tuned.SUFFIX)):
        found = tuned.read(path)
        assert tuned.file_name(found.key["gpu"]) == path.name
        limit = configs.FAMILY_SHARED_MEMORY[configs.arch_family(found.key["target"])]
        assert tuned.fits(found, limit, found.key["gpu"])[1] == []


def test_nearest_keeps_the_table_and_the_candidates_closest_to_it():
    table = Config(64, 64, 4, 2)
    found = [Config(128, 128, 8, 3), Config(64, 32, 4, 2), table, Config(64, 64, 4, 3), Config(32, 64, 4, 1)]
    assert nearest(found, table, None) == found
    assert nearest(found, table, 1) == [table]
    # one step each (a halved block, one stage more) before two (a halved block and a stage less)
    assert nearest(found, table, 3) == [table, Config(64, 32, 4, 2), Config(64, 64, 4, 3)]
    everything = [table, Config(64, 32, 4, 2), Config(64, 64, 4, 3), Config(32, 64, 4, 1), Config(128, 128, 8, 3)]
    assert nearest(found, table, 9) == everything
    pruned_table = [c for c in found if c != table]  # the table pruned away: the nearest others only
    assert nearest(pruned_table, table, 2) == [Config(64, 32, 4, 2), Config(64, 64, 4, 3)]


def test_the_tuner_times_at_most_max_candidates_and_keeps_the_fastest_of_them(launches, fake_gpu, monkeypatch):
    """``max_candidates`` (the campaign's shoot-out: 4) times the table's configuration and the
    nearest others; a faster candidate farther away is never timed, and the fastest timed wins."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    table = configs.get_config("interpreter", "fwd", 32, 2)
    near, far = table._replace(num_stages=table.num_stages + 1), Config(16, 16, 1, 1)
    speed = {table: 1.0, near: 0.8, far: 0.1}
    timed = []

    def timer(fn, trial):
        fn()
        timed.append(trial.config)
        return speed[trial.config]

    report = tune.tune(
        ["fwd"], [32], ["float16"], [32], device="cpu", timer=timer, check=SMALL, nheads=2, tokens=32,
        causal=(False,), grid={"fwd": [far, near]}, max_candidates=2, key=tuned.make_key(H100, "sm90"),
    )  # fmt: skip
    assert set(timed) == {table, near}
    assert {tuple(t["config"]): t["status"] for t in report["trials"]} == {table: "ok", near: "ok", far: "skipped"}
    (entry,) = report["configs"]
    assert Config(entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"]) == near
    assert tuned.read(report["path"]).configs == {("fwd", 32, 2): tuple(near)}


def test_a_bounded_run_saves_after_each_head_dim_and_starts_none_it_would_not_finish():
    """``seconds``: the head dims run one at a time (each kernel's configurations, then the
    backward's path); after each, the winners so far are saved and handed to ``checkpoint``, so a
    run stopped from outside keeps them. A head dim whose start plus the longest one's time would
    pass the bound is not started, and ``not_reached`` names it."""
    now = [0.0]

    def timer(fn, trial):
        now[0] += 10.0  # each timing: 10 s of the run's clock
        return 0.9 if trial.config == FAST else 1.0

    key = tuned.make_key(H100, "sm90")
    saved = []

    def checkpoint(report):
        document = json.loads(tuned.cache_path(H100).read_text())
        saved.append(([entry["head_dim"] for entry in report["configs"]], len(document["configs"])))

    report = tune.tune(
        ["fwd"], [16, 32, 64], ["float32"], [32], timer=timer, grid={"fwd": [FAST]}, key=key, seconds=45,
        checkpoint=checkpoint, clock=lambda: now[0], **TINY,
    )  # fmt: skip
    # Each head dim times two configurations (20 s): 16 from 0 s, 32 from 20 s (20 + 20 <= 45); 64
    # would start at 40 s and likely end at 60 s.
    assert saved == [([16], 1), ([16, 32], 2)]
    assert report["not_reached"] == [{"head_dim": 64, "dtypes": ["float32"]}]
    assert {entry["head_dim"] for entry in report["configs"]} == {16, 32}
    assert not any(trial["head_dim"] == 64 for trial in report["trials"])
    unbounded = tune.tune(
        ["fwd"], [16], ["float32"], [32], timer=lambda fn, trial: 1.0, grid={"fwd": [FAST]}, save=False,
        clock=lambda: 1e9, **TINY,
    )  # fmt: skip
    assert unbounded["not_reached"] == [] and len(unbounded["configs"]) == 1
