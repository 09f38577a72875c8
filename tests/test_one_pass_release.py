"""The one-pass backward's release rule (``configs.ONE_PASS_TRITON``, read by ``choose.one_pass_fits``)
is what the compile check measured: the releases listed for a (family, head-dim bucket) compile
its one-pass tile without spilling, the others run the three kernels. The table's rows are pinned
below; the compile test checks the installed release's row against a compile of the tile itself
(``python -m devtools.compile_check --call one_pass``), so a wrong entry for the installed
release fails."""

from __future__ import annotations

import pytest
import torch
from offline import compile_in_subprocess

from flash_recipe.ops import choose, configs, targets

# The releases the compile check found clean (bf16, aligned, MHA and GQA, with and without sinks).
# sm90 spills 136-200 B under 3.3, 208-296 B under 3.2, and with GQA and sinks 48 B under 3.6, 32 under
# 3.7, 16 under 3.8 (2026-12-04); 3.2's ptxas has no sm100.
MEASURED = {"sm90": ((3, 4), (3, 5), (3, 9)), "sm100": ((3, 3), (3, 4), (3, 5), (3, 6), (3, 7), (3, 8), (3, 9))}


def _fits(monkeypatch, target: str, head_dim: int, release: tuple[int, int]) -> bool:
    monkeypatch.setattr(targets, "triton_release", lambda: release)
    monkeypatch.setattr(targets, "target_of", lambda device: target)
    return choose.one_pass_fits(torch.device("cpu"), head_dim)


def test_the_table_lists_the_releases_the_compile_check_found_clean():
    assert {(family, 128): releases for family, releases in MEASURED.items()} == configs.ONE_PASS_TRITON


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_the_one_pass_runs_under_the_listed_releases_and_newer_ones(monkeypatch, target):
    measured = MEASURED[target]
    for release in [(3, minor) for minor in range(2, 13)] + [(4, 0)]:
        expected = release in measured or release > max(measured)
        assert _fits(monkeypatch, target, 128, release) is expected, release
        assert _fits(monkeypatch, target, 100, release) is expected, release  # the bucket of 128
        assert _fits(monkeypatch, target, 64, release)  # a bucket outside the table: every release


def test_families_outside_the_table_run_the_one_pass_under_every_release(monkeypatch):
    for target in ("sm80", "sm120", "gfx942", "interpreter"):
        assert _fits(monkeypatch, target, 128, (3, 2)) and _fits(monkeypatch, target, 128, (3, 6))


def test_an_empty_entry_means_no_release(monkeypatch):
    monkeypatch.setitem(configs.ONE_PASS_TRITON, ("sm90", 128), ())
    assert not _fits(monkeypatch, "sm90", 128, (3, 9)) and not _fits(monkeypatch, "sm90", 128, (9, 0))


@pytest.mark.slow
def test_the_installed_release_spills_the_tile_exactly_where_the_table_says(monkeypatch):
    """Compile the one-pass tile (forced, whatever the rule says) for sm90 and sm100 at head dim 128
    with the installed Triton: it is spill-free in every row (MHA, GQA, with sinks) exactly where
    ``one_pass_fits`` answers True for that release."""
    rows = compile_in_subprocess("""
        import json
        from devtools import compile_check
        case = compile_check.Case("one_pass", "bfloat16", 128, "aligned")
        for target in ("sm90", "sm100"):
            for row in compile_check.check_case(case, target):
                if row["kernel"] == "bwd_onepass":
                    print(json.dumps(row))
    """)
    release = targets.triton_release()
    for target in ("sm90", "sm100"):
        found = {row["case"]: row["spill_bytes"] for row in rows if row["target"] == target}
        assert sorted(found) == sorted(
            f"one_pass-bfloat16-d128-aligned{gqa}{sinks}" for gqa in ("", "-gqa") for sinks in ("", "-sinks")
        ), found
        clean = not any(found.values())
        fits = _fits(monkeypatch, target, 128, release)
        assert clean is fits, (
            f"Triton {release[0]}.{release[1]} on {target}: spills {found}, but configs.ONE_PASS_TRITON "
            f"says it {'is' if fits else 'is not'} clean"
        )
