"""The host path per call, bounded: Python function calls with Triton's launch stubbed.

A decoding loop calls attention once per layer per token, so what one call costs the host adds up
to milliseconds per token. ``flash_recipe.tools.host_cost`` counts the Python function calls of a
call that repeats a signature (``sys.setprofile``: frames entered, generator resumptions
included), with Triton's launch replaced by a recorder (no kernel runs, so what is counted is
this package's own work). The count is deterministic, so it is bounded here (``BOUNDS``) for
``flash_attn_func`` without autograd, with autograd recording the forward, forward and backward,
and ``flash_attn_with_kvcache`` with one new token appended.

This machine has no GPU: the kvcache case's metadata stands for device memory
(``validate.on_host`` answers False, the one decision a GPU call takes differently), so its
values are not read on the host, as on a GPU.

The memos that make a repeated call cheap must not change what a call checks or computes: the
tests below show a bad argument is refused on every call, and host metadata is checked on every
call, whatever came before with the same signature.
"""

from __future__ import annotations

import pytest
import torch

import flash_recipe
from flash_recipe import memo_keys
from flash_recipe.tools import host_cost

# The tool's counts on 2026-12-04 (CPython 3.11, Triton 3.9): 36, 40, 46 and 82, with four of room
# (37, 41, 46 and 83 on 2026-12-02, before the forward's plan was keyed by the call's token).
BOUNDS = {"fwd": 40, "fwd_autograd": 44, "kvcache": 50, "fwd_bwd": 86}
# Kernel launches per call: the forward; the kvcache step appends k and v in one launch, then attends; forward
# and backward: the forward, the preprocess, then the one pass or the dQ and dK/dV kernels (the
# installed Triton's release rule, ``configs.ONE_PASS_TRITON``).
LAUNCHES = {"fwd": (1,), "fwd_autograd": (1,), "kvcache": (2,), "fwd_bwd": (3, 4)}
CPU = torch.device("cpu")


def _count(case: str) -> tuple[int, int]:
    """``(Python calls, kernel launches)`` of a repeated call of ``case``, launches stubbed."""
    ours, _ = host_cost.make_case(case, CPU, torch.float16, host_cost.CACHE_CPU)
    with flash_recipe.use_backend("triton"), host_cost.device_metadata(CPU), host_cost.stubbed_launches() as launched:
        ours()  # the first call of the signature
        before = len(launched)
        calls = host_cost.count_calls(ours)
        return calls, len(launched) - before


@pytest.mark.parametrize("case", host_cost.CASES)
def test_a_repeated_call_stays_within_its_python_call_bound(case):
    calls, launches = _count(case)
    assert launches in LAUNCHES[case]  # the stub was reached: the whole host path was counted
    assert calls <= BOUNDS[case], f"{case}: {calls} Python calls per call, bound {BOUNDS[case]}"


@pytest.mark.parametrize("case", host_cost.CASES)
def test_the_bound_fails_when_every_call_does_the_first_calls_work(case, monkeypatch):
    """The planted regression: memos that never find anything (every call checks, chooses and
    plans again, as before they existed) break the bound."""
    monkeypatch.setattr(memo_keys.Memo, "get", lambda self, key, default=None: None)
    calls, launches = _count(case)
    assert launches in LAUNCHES[case]
    assert calls > BOUNDS[case]


def test_rounds_of_a_call_and_of_its_peer_alternate_and_their_ratios_give_the_median(monkeypatch):
    """``time_beside`` times a round of the call, then one of the peer (inside its context), and so
    on, so that both see the machine as it is in that round; the ratio is the median of the rounds'
    ratios, not the ratio of the medians (here 2.0, where the medians' ratio would be 4 / 3)."""
    order = []
    rounds = {"ours": iter([2.0, 4.0, 9.0]), "peer": iter([1.0, 4.0, 3.0])}

    def timed(fn, reps, count, device=None, warmup=3):
        name = fn()
        order.append((name, reps, count, warmup))
        return next(rounds[name])

    monkeypatch.setattr(host_cost, "time_calls", timed)
    entered = []

    class Context:
        def __enter__(self):
            entered.append(order[-1][0] if order else None)

        def __exit__(self, *exc):
            return False

    us, peer_us, ratio = host_cost.time_beside(lambda: "ours", lambda: "peer", Context, reps=7, rounds=3)
    assert [name for name, *_ in order] == ["ours", "peer"] * 3
    assert all(reps == 7 and count == 1 and warmup == 0 for _, reps, count, warmup in order)
    assert len(entered) == 3 + 3  # the peer's warming calls and each of its rounds inside its context
    assert (us, peer_us, ratio) == (4.0, 3.0, 2.0)


def test_the_call_counter_counts_every_frame():
    def leaf():
        return 1

    def two_calls():
        return leaf() + sum(x for x in (1, 2))  # leaf, and the generator's three resumptions

    assert host_cost.count_calls(two_calls) == 1 + 3  # fn itself is not counted


def _qkv(seed: int, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 9, 4, 16, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(causal=1), TypeError),  # equal to True, and refused
        (dict(window_size=(True, 0)), TypeError),  # equal to (1, 0), and refused
        (dict(softcap=float("nan")), ValueError),
        (dict(dropout_p=False), TypeError),  # equal to 0.0, and refused
    ],
    ids=["causal-int", "window-bool", "softcap-nan", "dropout-bool"],
)
def test_a_bad_option_is_refused_after_a_good_call_of_the_same_signature(bad, error):
    q, k, v = _qkv(0)
    good = dict(causal=True, window_size=(1, 0), softcap=0.0, dropout_p=0.0)
    flash_recipe.flash_attn_func(q, k, v, **good)
    with pytest.raises(error):
        flash_recipe.flash_attn_func(q, k, v, **{**good, **bad})


def test_host_offsets_are_checked_on_every_call():
    q, k, v = (t[0] for t in _qkv(1))
    good = torch.tensor([0, 4, 9], dtype=torch.int32)
    flash_recipe.flash_attn_varlen_func(q, k, v, good, good, 5, 5)
    bad = torch.tensor([0, 6, 4], dtype=torch.int32)  # same shape, dtype and device: decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flash_recipe.flash_attn_varlen_func(q, k, v, bad, good, 5, 5)


def test_host_cache_lengths_are_checked_on_every_call():
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    cache = torch.randn(2, 8, 2, 16, dtype=torch.float16)
    new = torch.randn(2, 1, 2, 16, dtype=torch.float16)
    fits = torch.tensor([3, 7], dtype=torch.int32)
    flash_recipe.flash_attn_with_kvcache(q, cache.clone(), cache.clone(), new, new, cache_seqlens=fits)
    with pytest.raises(ValueError, match="cache overflow"):
        flash_recipe.flash_attn_with_kvcache(q, cache.clone(), cache.clone(), new, new, cache_seqlens=fits + 1)


def test_calls_of_one_signature_compute_each_their_own_result():
    """A plan is made from the first call's tensors; the next call of the signature must read its own."""
    from flash_recipe.reference import attention_reference

    for seed in range(3):
        q, k, v = _qkv(seed, torch.float32)
        with flash_recipe.use_backend("triton"):
            got = flash_recipe.flash_attn_func(q, k, v, causal=True)
        want, _ = attention_reference(q, k, v, None, True)
        torch.testing.assert_close(got, want.to(got.dtype), atol=1e-5, rtol=1e-5)
