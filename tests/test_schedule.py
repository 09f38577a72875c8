"""The order a launch's programs take their query blocks and heads in (``flash_recipe.ops.schedule``).

Under the interpreter the programs run one after another in the order of their index, so the
order a kernel takes its blocks in is what the lse stores of each program show: each program
stores the lse of the rows it computed. The tests read that order, check it is the one
``launch_order`` states (heaviest query blocks first, ``section`` heads at a time, a narrower
last section), and check that the order changes no bit of any result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from offline import devtool_argv

import flash_recipe
from devtools import schedule_report
from flash_recipe import memo_keys
from flash_recipe.ops import backward_launch, forward, schedule

pytestmark = pytest.mark.usefixtures("bounds_checked")

MiB = 2**20


@pytest.mark.parametrize(
    ("heads", "query_blocks", "kv_bytes", "l2", "grows", "expected"),
    [
        (16, 64, 4 * MiB, 50 * MiB, True, 6),  # S8192 D128 bf16 on an H100: 25 MiB hold 6 heads' K and V
        (16, 128, 8 * MiB, 50 * MiB, True, 3),  # S16384
        (16, 16, 1 * MiB, 50 * MiB, True, 16),  # S2048: every head fits, capped at the heads there are
        (16, 64, 64 * MiB, 50 * MiB, True, 1),  # one head's K and V overflow the share: one at a time
        (16, 64, 4 * MiB, 50 * MiB, False, 1),  # no growing work (no causal mask): plain order
        (16, 1, 4 * MiB, 50 * MiB, True, 1),  # one query block: nothing to reorder
        (1, 64, 4 * MiB, 50 * MiB, True, 1),
        (2**20, 2**12, 1, 50 * MiB, True, 1),  # 2**32 programs in a batch entry: int32 would overflow
    ],
)
def test_section_heads_rule(heads, query_blocks, kv_bytes, l2, grows, expected):
    assert schedule.section_heads(heads, query_blocks, kv_bytes, l2, grows) == expected


def test_off_cuda_the_l2_is_the_default():
    assert schedule.l2_bytes(torch.device("cpu")) == schedule.DEFAULT_L2_BYTES


@pytest.fixture
def stores(monkeypatch):
    """Every store the interpreter makes: ``(program (x, y, z), active addresses)``, in order."""
    from triton.runtime import interpreter

    seen: list = []
    for name in ("create_store", "create_masked_store"):
        original = getattr(interpreter.InterpreterBuilder, name)

        def wrapped(self, ptrs, value, *rest, _original=original, _name=name, **kwargs):
            addresses = np.asarray(ptrs.data).ravel()
            if _name == "create_masked_store":
                mask = rest[0] if rest else kwargs["mask"]
                addresses = addresses[np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).ravel()]
            seen.append((tuple(self.grid_idx), addresses.copy()))
            return _original(self, ptrs, value, *rest, **kwargs)

        monkeypatch.setattr(interpreter.InterpreterBuilder, name, wrapped)
    return seen


def _order(seen, lse: torch.Tensor, grid: tuple):
    """The ``(query block, head, batch entry)`` whose lse rows each program stored, in launch order
    (``x + X * (y + Y * z)``, the index a GPU starts programs by)."""
    start = lse.untyped_storage().data_ptr()
    end = start + lse.untyped_storage().nbytes()
    _, heads, seqlen = lse.shape
    rows: dict = {}
    for (x, y, z), addresses in seen:
        inside = addresses[(addresses >= start) & (addresses < end)]
        if inside.size:
            rows.setdefault(x + grid[0] * (y + grid[1] * z), set()).update(int(a - start) // 4 for a in inside)
    block = -(-seqlen // grid[0])
    order = []
    for position in sorted(rows):
        places = {(r // (heads * seqlen), r // seqlen % heads, r % seqlen // block) for r in rows[position]}
        assert len(places) == 1, "a program stored rows of two heads or two query blocks"
        ((b, h, m),) = places
        order.append((m, h, b))
    return order


@pytest.fixture
def planned(monkeypatch):
    """The forward plans made while the test runs (each memo emptied first, so every call plans)."""
    memo_keys.forget()
    made: list = []
    original = forward.plan_forward

    def plan_forward(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(forward, "plan_forward", plan_forward)
    yield made
    memo_keys.forget()


@pytest.mark.parametrize("section", [1, 2, 4])
def test_the_forward_runs_the_heaviest_blocks_first_a_section_at_a_time(section, stores, planned, monkeypatch, device):
    """Two batch entries of three heads: six heads in sections of 2, or one section of all six (4
    leaves a remainder of 2, which the last section takes)."""
    if device.type != "cpu":
        pytest.skip("reads the interpreter's stores")
    monkeypatch.setattr(forward, "launch_section", lambda *args: section)
    batch, heads, seqlen = 2, 3, 128
    q, k, v = (torch.randn(batch, seqlen, heads, 32, dtype=torch.float16) for _ in range(3))
    _, lse, _ = flash_recipe.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    (plan,) = planned
    blocks = plan.main.grid[0]
    assert blocks > 1 and plan.main.scalars["head_section"] == section
    sections = {1: [[0], [1], [2], [3], [4], [5]], 2: [[0, 1], [2, 3], [4, 5]], 4: [[0, 1, 2, 3, 4, 5]]}[section]
    expected = [(m, f % heads, f // heads) for part in sections for m in reversed(range(blocks)) for f in part]
    assert _order(stores, lse, plan.main.grid) == expected
    assert [(m, f % heads, f // heads) for m, f in schedule.launch_sequence(blocks, batch * heads, section)] == expected


def test_a_causal_forward_plans_sections_from_the_l2_and_a_plain_one_does_not(planned, monkeypatch):
    monkeypatch.setattr(schedule, "l2_bytes", lambda device: 2 * 2 * (2 * 128 * 32 * 2))  # half: 2 heads' K and V
    q, k, v = (torch.randn(1, 128, 3, 32, dtype=torch.float16) for _ in range(3))
    flash_recipe.flash_attn_func(q, k, v, causal=True)
    flash_recipe.flash_attn_func(q, k, v, causal=False)
    flash_recipe.flash_attn_func(q, k, v, window_size=(16, 0))  # a left window: about equal blocks
    monkeypatch.setattr(schedule, "l2_bytes", lambda device: 2**30)
    flash_recipe.flash_attn_func(q, k, v, causal=True, softcap=5.0)  # another signature: plans again
    assert [p.main.scalars["head_section"] for p in planned] == [2, 1, 1, 3]


@pytest.mark.parametrize("causal", [True, False])
def test_the_order_changes_no_bit(causal, monkeypatch, device):
    """Forward, the one-pass backward and the deterministic one (the dQ kernel takes the order too),
    over 2 x 3 heads in sections of 1 (each head's blocks in turn), 2, and 4 (the remainder joins)."""
    heads, seqlen = 3, 96
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, seqlen, heads, 32, generator=g).to(device, torch.float16) for _ in range(4))
    results = []
    for section in (1, 2, 4):
        memo_keys.forget()  # plan again, with this section
        monkeypatch.setattr(forward, "launch_section", lambda *args, _s=section: _s)
        monkeypatch.setattr(backward_launch, "launch_section", lambda *args, _s=section: _s)
        got = []
        for deterministic in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = flash_recipe.flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
            out.backward(dout)
            got += [out.detach(), *(t.grad for t in leaves)]
        results.append(got)
    memo_keys.forget()
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_the_model_finds_the_order_no_slower_than_the_plain_one():
    """The model behind docs/performance.md's table: every causal shape ends sooner (or as soon) in
    this order, and the plain order's tail is what the table says it is."""
    rows = schedule_report.model_rows()
    assert [r[:3] for r in rows] == list(schedule_report.MODEL_SHAPES)
    for *_, plain, ordered, persistent, balanced in rows:
        assert 1.0 <= ordered <= plain
        assert persistent > 1.1 * ordered  # a grid-stride loop strands the heavy blocks' stragglers
        assert 1.0 <= balanced <= persistent  # dealt heaviest first: within a few percent of the dispatch
    assert max(r[-4] for r in rows) > 1.05  # the plain order's tail is worth reordering for
    assert schedule_report.model_time([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    assert schedule_report.model_time([1.0, 1.0, 1.0, 3.0], 2) == 4.0
    assert schedule_report.persistent_time([3.0, 1.0, 1.0, 1.0], 2) == 4.0  # slot 0: units 0 and 2
    assert schedule_report.persistent_time([2.0] * 6, 3) == schedule_report.model_time([2.0] * 6, 3) == 4.0
    assert schedule_report.balanced_persistent_time([1.0, 4.0, 2.0, 3.0], 2) == 5.0  # 4 + 1 and 3 + 2


def test_the_module_prints_the_model_table():
    import subprocess

    printed = subprocess.run(devtool_argv("schedule_report"), capture_output=True, text=True, check=True).stdout
    assert "A model, not a timing" in printed
    assert "| B2 S8192 H16 | 2048 | 6 |" in printed
