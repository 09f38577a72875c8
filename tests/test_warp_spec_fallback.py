"""Warp specialisation where the installed Triton compiles it, and the fall back when a launch fails.

``features.warp_specialization_triton_problem`` (the release rule, ``WARP_SPEC_TRITON``),
``choose.tuned_fallback`` (a warp-specialised forward that fails where the plain one runs: the
plain forward serves it from then on, with one ``WarpSpecializationWarning``), and the compile
check's ``fwd_ws`` rows ("not enabled on this Triton" where the rule is off, a failure where the
rule is on and the compile fails)."""

from __future__ import annotations

import warnings

import pytest
import torch
from offline import compile_in_subprocess

import flash_recipe
from devtools import compile_check
from flash_recipe.ops import configs, features, forward, targets

needs_warp_spec = pytest.mark.skipif(
    not (features.descriptors_available() and features.warp_specialization_available()),
    reason="this Triton has no tensor descriptors or no warp specialisation",
)
PASS_MANAGER = "PassManager::run failed"  # what Triton 3.6 raises for the sm100 forward at head dims 64 and 128


@pytest.fixture(autouse=True)
def _no_failures(monkeypatch):
    """Each test starts and ends with no pair rejected, and without the environment's request."""
    monkeypatch.delenv(features.WARP_SPEC_ENV, raising=False)
    features.forget_warp_specialization_failures()
    yield
    features.forget_warp_specialization_failures()


@pytest.fixture
def failing_launches(monkeypatch):
    """The forward kernel's launches raise ``RuntimeError(PASS_MANAGER)`` where their ``WARP_SPEC``
    is in ``failing`` (a set the test fills); ``launched`` lists each launch's ``WARP_SPEC``."""
    original, state = forward.attn_fwd_kernel.fn.run, {"failing": set(), "launched": []}

    def run(*args, **kwargs):
        state["launched"].append(kwargs.get("WARP_SPEC"))
        if kwargs.get("WARP_SPEC") in state["failing"]:
            raise RuntimeError(PASS_MANAGER)
        return original(*args, **kwargs)

    monkeypatch.setattr(forward.attn_fwd_kernel.fn, "run", run)
    return state


def _inputs(head_dim: int = 64):
    torch.manual_seed(0)
    return tuple(torch.randn(1, 48, 2, head_dim, dtype=torch.float16) for _ in range(3))


def _forward(q, k, v, warp_spec: bool):
    with (
        flash_recipe.use_backend("triton"),
        features.using_descriptors(True),
        features.using_warp_specialization(warp_spec),
    ):
        return flash_recipe.flash_attn_func(q, k, v, causal=True)


def _caught(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, features.WarpSpecializationWarning)]


@needs_warp_spec
def test_a_failing_warp_specialised_forward_falls_back_to_the_plain_one_and_says_so_once(failing_launches, device):
    """The warp-specialised launch raises what Triton 3.6's pass pipeline raises: the call returns
    the plain forward's bits, one warning names FLASH_RECIPE_WARP_SPEC, the target, the head dim and
    the error, and later calls take the plain forward at once (no second try, no second warning)."""
    if not features.takes_warp_specialization(targets.target_of(device)):
        pytest.skip(f"{targets.target_of(device)} is not offered warp specialisation")
    q, k, v = (t.to(device) for t in _inputs())
    plain = _forward(q, k, v, warp_spec=False)
    failing_launches["failing"].add(True)
    failing_launches["launched"].clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        outs = [_forward(q, k, v, warp_spec=True) for _ in range(3)]
    assert all(torch.equal(out, plain) for out in outs)
    assert failing_launches["launched"] == [True, False, False, False]  # tried once, then plain
    (message,) = _caught(record)
    bucket = configs.head_dim_bucket(q.shape[-1])
    assert features.WARP_SPEC_ENV in message and PASS_MANAGER in message, message
    assert f"{targets.target_of(device)} at head dim {bucket}" in message, message
    # Another head dim is tried on its own (and falls back with a warning of its own).
    q32, k32, v32 = (t.to(device) for t in _inputs(32))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _forward(q32, k32, v32, warp_spec=True)
        _forward(q32, k32, v32, warp_spec=True)
    assert len(_caught(record)) == 1 and "head dim 32" in _caught(record)[0]
    # Forgotten, the failing pair is tried again.
    features.forget_warp_specialization_failures()
    failing_launches["launched"].clear()
    with pytest.warns(features.WarpSpecializationWarning):
        _forward(q, k, v, warp_spec=True)
    assert failing_launches["launched"] == [True, False]


@needs_warp_spec
def test_a_failure_of_the_plain_forward_is_not_swallowed(failing_launches, device):
    """Not asked for, the plain forward's failure propagates as it is. Asked for, where the plain
    forward fails too, the plain forward's failure propagates, no warning is given and nothing is
    rejected: the next call tries the warp-specialised forward again."""
    if not features.takes_warp_specialization(targets.target_of(device)):
        pytest.skip(f"{targets.target_of(device)} is not offered warp specialisation")
    q, k, v = (t.to(device) for t in _inputs())
    failing_launches["failing"].update({False, True})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=PASS_MANAGER):
            _forward(q, k, v, warp_spec=False)
        assert failing_launches["launched"] == [False]
        failing_launches["launched"].clear()
        for _ in range(2):
            with pytest.raises(RuntimeError, match=PASS_MANAGER) as raised:
                _forward(q, k, v, warp_spec=True)
            assert isinstance(raised.value.__context__, RuntimeError)  # the specialised launch's failure
    assert failing_launches["launched"] == [True, False, True, False]
    assert not _caught(record)


@needs_warp_spec
def test_an_error_outside_the_kernels_is_not_taken_for_a_compile_failure(monkeypatch, device):
    """An error raised before any launch (here by the output allocation) propagates unchanged from
    a warp-specialised call, once the plain run hits it too; no warning."""
    if not features.takes_warp_specialization(targets.target_of(device)):
        pytest.skip(f"{targets.target_of(device)} is not offered warp specialisation")
    q, k, v = (t.to(device) for t in _inputs())

    def no_memory(*args, **kwargs):
        raise MemoryError("no memory for the output")

    monkeypatch.setattr(forward.tiles, "output_buffer", no_memory)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(MemoryError, match="no memory for the output"):
            _forward(q, k, v, warp_spec=True)
    assert not _caught(record)


def test_the_release_rule_enables_it_where_that_triton_compiles_it(monkeypatch):
    """Triton 3.6 (torch 2.10 and 2.11's pin) compiles the sm100 forward cleanly at head dims 16 and
    32 and fails at 64 and 128; 3.7 spills at 16 to 64 and fails at 128; 3.8 and 3.9 compile all
    four, and a newer release is taken to. Asked for, a launch under 3.6 at head dim 64 runs the
    plain forward (no error); the interpreter runs it under every release."""
    monkeypatch.setattr(features, "warp_specialization_available", lambda: True)
    assert set(features.WARP_SPEC_TRITON) == {
        (f, d) for f in features.WARP_SPEC_FAMILIES for d in features.WARP_SPEC_HEAD_DIMS
    }

    def enabled(release):
        monkeypatch.setattr(targets, "triton_release", lambda: release)
        return [d for d in (16, 32, 40, 64, 128) if not features.warp_specialization_triton_problem("sm100", d)]

    assert enabled((3, 5)) == [] and enabled((3, 7)) == []
    assert enabled((3, 6)) == [16, 32]  # 40 takes the bucket of 64
    assert enabled((3, 8)) == enabled((3, 9)) == enabled((3, 12)) == enabled((4, 0)) == [16, 32, 40, 64, 128]
    monkeypatch.setattr(targets, "triton_release", lambda: (3, 6))
    problem = features.warp_specialization_triton_problem("sm100", 64)
    assert problem == (
        "Triton 3.6 is not one of the releases that compile it cleanly for sm100 at head dim 64: "
        "3.8, 3.9 and newer (WARP_SPEC_TRITON)"
    )
    assert features.warp_specialization_triton_problem("interpreter", 128) is None
    with features.using_warp_specialization(True):
        assert features.warp_specialization("sm100", 32, plain=True)
        assert not features.warp_specialization("sm100", 64, plain=True)
        assert not features.warp_specialization("sm100", 128, plain=True)
        assert features.warp_specialization("interpreter", 128, plain=True)
    monkeypatch.setattr(features, "warp_specialization_available", lambda: False)
    assert "tl.range takes no warp_specialize" in features.warp_specialization_triton_problem("sm100", 16)


def test_the_compile_check_reports_what_the_rule_leaves_off_as_not_enabled(monkeypatch):
    """Where the rule is off on the installed Triton, a ``fwd_ws`` case compiles nothing and passes
    with the rule's reason; where the target is not offered it (sm90) or the rule is on, the case
    compiles (``warp_spec_not_enabled`` is None)."""
    monkeypatch.setattr(features, "warp_specialization_available", lambda: True)
    monkeypatch.setattr(targets, "triton_release", lambda: (3, 6))
    case = compile_check.Case("fwd_ws", "bfloat16", 128, "aligned")
    (row,) = compile_check.check_case(case, "sm100")
    assert row["ok"] and not row["problems"] and "Triton 3.6 is not one of" in row["not_enabled"], row
    assert "not enabled on this Triton" in compile_check._line(row)
    assert compile_check.warp_spec_not_enabled(case, "sm90") is None
    assert compile_check.warp_spec_not_enabled(compile_check.Case("fwd_ws", "bfloat16", 16, "aligned"), "sm100") is None
    assert compile_check.warp_spec_not_enabled(compile_check.Case("fwd", "bfloat16", 128, "aligned"), "sm100") is None


@pytest.mark.slow
def test_the_compile_check_fails_a_warp_specialised_forward_the_rule_enables_and_that_fails_to_compile():
    """Planted: every warp-specialised launch raises what Triton 3.6's pass pipeline raises. Where
    the rule enables it (sm100, head dim 16: Triton 3.6, 3.8 and newer), the launcher falls back, and the
    check turns its warning into a failing row that names the error; the rule and the check agree
    on the rest (the plain sm90 forward passes)."""
    if features.warp_specialization_triton_problem("sm100", 16):
        pytest.skip(features.warp_specialization_triton_problem("sm100", 16))
    rows = compile_in_subprocess(f"""
        import json
        from triton.runtime.jit import JITFunction
        from devtools import compile_check
        run = JITFunction.run

        def failing(self, *args, **kwargs):
            if kwargs.get("WARP_SPEC"):
                raise RuntimeError({PASS_MANAGER!r})
            return run(self, *args, **kwargs)

        JITFunction.run = failing
        for target in ("sm100", "sm90"):
            for row in compile_check.check_job((compile_check.Case("fwd_ws", "bfloat16", 16, "aligned"), target)):
                print(json.dumps(row))
    """)
    blackwell = [row for row in rows if row["target"] == "sm100"]
    assert len(blackwell) == 1 and not blackwell[0]["ok"], blackwell
    assert "WarpSpecializationWarning" in blackwell[0]["problems"][0] and PASS_MANAGER in blackwell[0]["problems"][0]
    hopper = [row for row in rows if row["target"] == "sm90"]
    assert len(hopper) == 2 and all(row["ok"] and row["kernel"] == "fwd" for row in hopper), hopper


def test_the_triton_preset_compiles_the_default_calls_and_the_warp_specialised_forward():
    """``--preset triton`` (``nox -s compile_check_triton``): the forward, backward and decode step
    for sm80, sm90 and sm100 at head dim 128 in bf16, aligned; and ``fwd_ws`` on sm100 at every
    head dim it is offered, aligned in bf16, as in the ``ci`` and ``compat`` presets."""
    jobs = compile_check.select_jobs("triton")
    ws = {(c.head_dim, c.form, c.dtype, t) for c, t in jobs if c.call == "fwd_ws"}
    assert ws == {(d, "aligned", "bfloat16", "sm100") for d in features.WARP_SPEC_HEAD_DIMS}
    for preset in ("ci", "compat"):
        assert ws == {
            (c.head_dim, c.form, c.dtype, t) for c, t in compile_check.select_jobs(preset) if c.call == "fwd_ws"
        }
    rest = {(c.call, c.dtype, c.head_dim, c.form, t) for c, t in jobs if c.call != "fwd_ws"}
    assert rest == {
        (call, "bfloat16", 128, "aligned", t) for call in ("fwd", "bwd", "decode") for t in ("sm80", "sm90", "sm100")
    }
