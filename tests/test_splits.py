"""The split-KV rule (``flash_recipe.ops.splits``) as a table, on the CPU.

Every row of the campaign's decode grid (``tools/campaign/plan.py``: DECODE_BATCHES x
DECODE_CACHES, Llama-3-8B's H=32 over Hk=8 at D=128, bf16, one query row) on an A100 (108 SMs,
sm80), an H100/H200 (132, sm90) and an RTX 4090 (128, sm89) must satisfy five properties of the
choice (``violations``): (a) the launch fills the SMs unless the cache is too short to split
further, (b) within the key blocks and the cap, (c) 1 when the programs alone make a wave, (d) a
well-filled last wave or the best available, and (e) packing and splitting together are never
slower than the unpacked path on the proxy (``splits_report.critical_path``). Deliberately wrong rules
must break them, so the checks can fail. The wiring through ``kvcache.heuristic_splits`` runs with
only the GPU driver faked, as tests/test_tune.py fakes it.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from offline import devtool_argv

from devtools import splits_report
from devtools.campaign import plan
from flash_recipe import decoding
from flash_recipe.ops import configs, kvcache, limits, splits, targets, tuned
from flash_recipe.ops.splits import GOOD_WAVE_EFFICIENCY, MAX_SPLITS, PROGRAMS_PER_SM, choose_splits

H, HK, D, SIZE = 32, 8, 128, 2  # Llama-3-8B, bf16
GPUS = {
    108: ("sm80", "NVIDIA A100-SXM4-80GB", 8, 0),
    132: ("sm90", "NVIDIA H100 80GB HBM3", 9, 0),
    128: ("sm89", "NVIDIA GeForce RTX 4090", 8, 9),
}
FAMILY = {"sm80": "sm80", "sm90": "sm90", "sm89": "sm86"}


def _key_blocks(cache: int, target: str) -> int:
    return -(-cache // configs.get_config(target, "decode", D, SIZE).block_n)


GRID = [
    pytest.param(batch, cache, sms, id=f"B{batch}-S{cache}-sm{sms}")
    for sms in GPUS
    for batch in plan.DECODE_BATCHES
    for cache in plan.DECODE_CACHES
]


def _candidates(programs: int, key_blocks: int, sms: int) -> list[int]:
    """The counts the rule may choose among: 1 when the programs make a wave; else those from the
    fewest that make one up to the key blocks and the cap (only the most there is when the cache is
    too short to reach a wave)."""
    wave = sms * PROGRAMS_PER_SM
    if programs == 0 or programs >= wave:
        return [1]
    most = max(1, min(key_blocks, MAX_SPLITS))
    fewest = -(-wave // programs)
    return [most] if fewest >= most else list(range(fewest, most + 1))


def violations(rule, batch: int, key_blocks: int, sms: int) -> list[str]:
    """The properties that ``rule(programs, key_blocks, sms)`` breaks for a one-row decoding step of
    ``batch`` (packed: ``batch * Hk`` programs; unpacked: ``batch * H``)."""
    packed, unpacked = batch * HK, batch * H
    chosen = rule(packed, key_blocks, sms)
    found = []
    if packed * chosen < sms and chosen != key_blocks:
        found.append("a: the launch leaves SMs idle though the cache could split further")
    if not 1 <= chosen <= min(max(key_blocks, 1), MAX_SPLITS):
        found.append("b: more splits than key blocks or the cap")
    if packed >= sms * PROGRAMS_PER_SM and chosen != 1:
        found.append("c: splits although the programs alone make a wave")
    efficiency = splits.wave_efficiency(packed, chosen, sms)
    best = max(splits.wave_efficiency(packed, s, sms) for s in _candidates(packed, key_blocks, sms))
    if efficiency < GOOD_WAVE_EFFICIENCY and efficiency < best:
        found.append(f"d: wave efficiency {efficiency:.2f}, below {GOOD_WAVE_EFFICIENCY} and the best {best:.2f}")
    packed_path = splits_report.critical_path(packed, chosen, key_blocks, sms)
    unpacked_path = splits_report.critical_path(unpacked, rule(unpacked, key_blocks, sms), key_blocks, sms)
    if packed_path > unpacked_path:
        found.append(f"e: packed path {packed_path} key blocks, unpacked {unpacked_path}")
    return found


@pytest.mark.parametrize("batch, cache, sms", GRID)
def test_the_rule_holds_on_every_row_of_the_decode_grid(batch, cache, sms):
    assert violations(choose_splits, batch, _key_blocks(cache, GPUS[sms][0]), sms) == []


def _always_one(programs, key_blocks, sms):
    return 1


def _smallest_wave(programs, key_blocks, sms):  # ignores the last wave and the key blocks
    return max(1, -(-sms * PROGRAMS_PER_SM // programs))


def _always_two_waves(programs, key_blocks, sms):
    return min(max(1, 2 * sms * PROGRAMS_PER_SM // programs), key_blocks, MAX_SPLITS)


def _shy(programs, key_blocks, sms):  # declines to split a small launch: packed launches lose
    return 1 if programs < sms // 4 else choose_splits(programs, key_blocks, sms)


def _fixed_last(programs, key_blocks, sms):  # the most splits the cache takes, always
    return min(key_blocks, MAX_SPLITS)


@pytest.mark.parametrize(
    "rule, broken",
    [
        (_always_one, "a"),
        (_smallest_wave, "b"),
        (_smallest_wave, "d"),
        (_always_two_waves, "c"),
        (_shy, "e"),
        (_fixed_last, "c"),
    ],
    ids=["always-1-a", "smallest-wave-b", "smallest-wave-d", "two-waves-c", "shy-e", "most-c"],
)
def test_a_wrong_rule_breaks_the_property_it_ignores(rule, broken):
    """The checks can fail: each wrong rule breaks its property on some row of the grid."""
    found = {
        v[0]
        for batch in plan.DECODE_BATCHES
        for cache in plan.DECODE_CACHES
        for sms, (target, *_) in GPUS.items()
        for v in violations(rule, batch, _key_blocks(cache, target), sms)
    }
    assert broken in found


@pytest.mark.parametrize(
    "programs, key_blocks, sms, expected",
    [
        pytest.param(8, 1, 132, 1, id="one-key-block"),
        pytest.param(8, 0, 132, 1, id="empty-cache"),
        pytest.param(0, 512, 132, 1, id="no-programs"),
        pytest.param(10**9, 512, 132, 1, id="programs-huge"),
        pytest.param(264, 512, 132, 1, id="programs-exactly-a-wave"),
        pytest.param(263, 512, 132, 2, id="programs-one-short-of-a-wave"),
        pytest.param(1, 10**6, 1, 2, id="sms-1"),
        pytest.param(3, 10**6, 1, 1, id="sms-1-filled"),
        pytest.param(1, 10**6, 1000, MAX_SPLITS, id="cap"),
        pytest.param(1, 5, 132, 5, id="cache-too-short"),
        pytest.param(7, 10**6, 132, 65, id="last-wave-well-filled"),
    ],
)
def test_edge_cases(programs, key_blocks, sms, expected):
    assert choose_splits(programs, key_blocks, sms) == expected


def test_seven_programs_take_a_well_filled_second_wave_over_a_nearly_empty_one():
    """38 splits of 7 programs are 266 on 264 slots: 2 programs in a second wave (efficiency 0.50);
    the rule goes on to 65 (455 programs, 1.72 waves, 0.86)."""
    assert splits.wave_efficiency(7, 38, 132) == pytest.approx(266 / 528)
    assert choose_splits(7, 10**6, 132) == 65
    assert splits.wave_efficiency(7, 65, 132) >= GOOD_WAVE_EFFICIENCY > splits.wave_efficiency(7, 64, 132)


@pytest.mark.parametrize(
    "args, error, words",
    [
        ((-1, 8, 132), ValueError, ["programs", "at least 0", "-1"]),
        ((8, -2, 132), ValueError, ["key_blocks", "at least 0", "-2"]),
        ((8, 8, 0), ValueError, ["sms", "at least 1", "0"]),
        ((2.5, 8, 132), TypeError, ["programs", "int", "float"]),
        ((8, 8, True), TypeError, ["sms", "int", "bool"]),
    ],
    ids=["programs-negative", "key-blocks-negative", "sms-zero", "programs-float", "sms-bool"],
)
def test_bad_arguments_are_named(args, error, words):
    with pytest.raises(error) as info:
        choose_splits(*args)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_the_caps_agree():
    """flash-attn's 128: the most a caller may ask for, the rule may choose, a tuned file may hold,
    defined once (``ops.limits``)."""
    assert decoding.MAX_SPLITS == splits.MAX_SPLITS == tuned.MAX_SPLITS == limits.MAX_SPLITS == 128
    for module in (decoding, splits, tuned):
        assert "MAX_SPLITS =" not in inspect.getsource(module), f"{module.__name__} defines its own MAX_SPLITS"


# -- the table ----------------------------------------------------------------------------------

# The splits column of ``python -m devtools.splits_report`` for the grid, per SM count, in the
# order batch x cache (1024, 8192, 32768). Regenerate it there when the rule changes on purpose.
TABLE = {
    108: [16, 27, 27, 6, 6, 6, 1, 1, 1, 1, 1, 1],
    132: [16, 33, 33, 8, 8, 8, 2, 2, 2, 1, 1, 1],
    128: [16, 32, 32, 4, 4, 4, 1, 1, 1, 1, 1, 1],
}


def test_the_table_is_the_campaign_grid_and_says_what_the_rule_chooses():
    assert (splits_report.TABLE_BATCHES, splits_report.TABLE_CACHES) == (plan.DECODE_BATCHES, plan.DECODE_CACHES)
    assert splits_report.TABLE_SHAPE == {"nheads": H, "nheads_k": HK, "head_dim": D, "element_size": SIZE}
    rows = splits_report.split_table()
    assert len(rows) == len(GRID)
    for row in rows:
        assert FAMILY[row.target] == configs.arch_family(row.target) and GPUS[row.sms][0] == row.target
        assert row.programs == row.batch * HK and row.unpacked_programs == row.batch * H
        assert row.key_blocks == _key_blocks(row.cache, row.target)
        assert row.splits == choose_splits(row.programs, row.key_blocks, row.sms)
        assert row.waves == pytest.approx(row.programs * row.splits / (row.sms * PROGRAMS_PER_SM))
        assert row.path <= row.unpacked_path
    assert {sms: [r.splits for r in rows if r.sms == sms] for sms in GPUS} == TABLE
    table = splits_report.markdown(rows)
    assert len(table.splitlines()) == 2 + len(rows) and "| 132 (sm90) | 8 | 8192 | 128 | 64 | 8 |" in table


def test_the_module_prints_the_table():
    import subprocess

    done = subprocess.run(
        devtool_argv("splits_report"),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "| 108 (sm80) | 1 | 1024 | 16 | 8 | 16 |" in done.stdout


# -- the wiring: kvcache.heuristic_splits on a faked GPU ----------------------------------------


class _Properties:
    """What ``torch.cuda.get_device_properties`` answers for the faked GPU; ``sm_queries`` counts the
    reads of its multiprocessor count."""

    def __init__(self, state):
        self.state = state
        target, self.name, self.major, self.minor = GPUS[state.sms]
        self.shared_memory_per_block_optin = configs.SHARED_MEMORY_LIMIT[target]

    @property
    def multi_processor_count(self):
        self.state.sm_queries += 1
        return self.state.sms


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """Only the missing driver is faked: device 0 is the GPU of ``fake_gpu.sms`` SMs (the test sets
    it), the interpreter is off and the tuned cache is an empty directory."""
    state = types.SimpleNamespace(sms=132, sm_queries=0)

    def properties(device):
        return _Properties(state)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "no-tuned-files"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPUS[state.sms][1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for forget in (targets.gpu_target.cache_clear, splits.sm_count.cache_clear, tuned.forget):
        forget()
    yield state
    for forget in (targets.gpu_target.cache_clear, splits.sm_count.cache_clear, tuned.forget):
        forget()


CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("sms", list(GPUS), ids=[f"sm{s}" for s in GPUS])
def test_the_heuristic_counts_the_launch_as_it_runs(fake_gpu, sms):
    """Packed (Hk heads of 4 rows: one query tile each) and unpacked (H heads of 1 row), the
    programs and key blocks of the decode configuration reach ``choose_splits``."""
    fake_gpu.sms = sms
    target = GPUS[sms][0]
    assert targets.target_of(CUDA0) == target
    for batch in plan.DECODE_BATCHES:
        for cache in plan.DECODE_CACHES:
            blocks = _key_blocks(cache, target)
            packed = kvcache.auto_splits(batch, HK, H // HK, cache, CUDA0, D, SIZE)
            assert packed == choose_splits(batch * HK, blocks, sms), (batch, cache)
            unpacked = kvcache.heuristic_splits(batch, H, 1, cache, CUDA0, D, SIZE)
            assert unpacked == choose_splits(batch * H, blocks, sms), (batch, cache)
    assert fake_gpu.sm_queries == 1  # the SM count was asked once


def test_longer_queries_count_the_general_forwards_query_blocks(fake_gpu):
    cfg = configs.get_config("sm90", "fwd_general", D, SIZE)
    assert kvcache.launch_blocks(CUDA0, 200, D, SIZE) == (-(-200 // cfg.block_m), cfg.block_n)
    decode = configs.get_config("sm90", "decode", D, SIZE)
    assert kvcache.launch_blocks(CUDA0, 64, D, SIZE) == (1, decode.block_n)  # a packed group's one tile
    programs = 2 * 4 * -(-200 // cfg.block_m)
    assert kvcache.heuristic_splits(2, 4, 200, 4096, CUDA0, D, SIZE) == choose_splits(
        programs, -(-4096 // cfg.block_n), 132
    )


def test_sm_count_asks_once_per_device(fake_gpu):
    assert splits.sm_count(CUDA0) == splits.sm_count(0) == splits.sm_count(torch.device("cuda")) == 132
    assert fake_gpu.sm_queries == 1
    fake_gpu.sms = 108
    assert splits.sm_count(CUDA0) == 132  # kept
    splits.sm_count.cache_clear()
    assert splits.sm_count(CUDA0) == 108 and fake_gpu.sm_queries == 2


def test_off_cuda_there_is_one_split():
    assert kvcache.heuristic_splits(1, HK, 4, 32768, torch.device("cpu"), D, SIZE) == 1
    assert kvcache.auto_splits(1, HK, 4, 32768, torch.device("cpu"), D, SIZE) == 1


def test_a_decoding_step_packs_its_group_into_one_program_per_kv_head():
    """What the grid's programs assume: Llama's group of 4 packs into Hk programs (on the CPU the
    interpreter's decode configuration decides the same)."""
    q = torch.empty(2, 1, H, D)
    assert kvcache.program_heads(q, HK) == (HK, H // HK)
    assert kvcache.program_heads(q, HK, pack_gqa=False) == (H, 1)
