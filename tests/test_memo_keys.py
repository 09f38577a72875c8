"""Every memo key is derived from its records' fields (``flash_recipe.memo_keys.Fields``), never
written by hand: a field added to ``ScoreOptions`` or to the call records reaches every key.

- ``test_fields_split_every_field``: each record's fields split into tensors and values, once each;
- ``test_*_key_reads_every_field``: changing any one field of any record a key is built from
  (``ScoreOptions``, ``Varlen``, ``KeyRanges``, ``Cache``, ``Rotary``, ``AttentionCall``,
  ``FlashOptions``) changes that key (structure: a field no key reads fails here);
- ``test_*_memo_entry_per_option``: for each layer that memoises, two calls differing only in one
  option get two memo entries (and two plans); the same call again reuses its entry.

Pure Python on CPU tensors: the planners and launchers are replaced by stubs, nothing compiles or runs.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

import flash_recipe
import flash_recipe.dispatch as dispatch
from flash_recipe import call_builder, decoding
from flash_recipe.call_builder import FlashOptions
from flash_recipe.dispatch.call import CALL_FIELDS, AttentionCall
from flash_recipe.memo_keys import Fields, Memo
from flash_recipe.ops import backward_launch, forward, kvcache
from flash_recipe.ops.forward import ForwardPlan
from flash_recipe.ops.kvcache import Cache, Rotary, StepPlan
from flash_recipe.ops.options import (
    KEY_RANGE_FIELDS,
    SCORE_FIELDS,
    VARLEN_FIELDS,
    KeyRanges,
    ScoreOptions,
    Varlen,
)

B, SQ, SK, H, HK, D = 2, 4, 6, 4, 2, 16  # batch, query/key length, query/key heads, head dim


def _tensors():
    """Dense ``q (B, SQ, H, D)``, ``k, v (B, SK, HK, D)``."""
    return torch.zeros(B, SQ, H, D), torch.zeros(B, SK, HK, D), torch.zeros(B, SK, HK, D)


def _int32(*shape):
    return torch.zeros(shape, dtype=torch.int32)


OPTIONS = ScoreOptions(
    softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None
)
VARLEN = Varlen(_int32(B + 1), _int32(B + 1), SQ, SK)
KEYS = KeyRanges(_int32(B), _int32(B), SK)
CACHE = Cache(torch.zeros(B, SK, HK, D), torch.zeros(B, SK, HK, D), _int32(B, 1), _int32(B), None)
ROTARY = Rotary(torch.zeros(SK, D // 2), torch.zeros(SK, D // 2), False)
CALL = AttentionCall(q=_tensors()[0], k=_tensors()[1], v=_tensors()[2], softmax_scale=0.25)
FLASH = FlashOptions()

# One other value per field of each record: valid where the layer checks it (the flash-attn call).
# A field added to a record needs one here (``test_every_field_has_a_variant``).
VARIANTS = {
    ScoreOptions: dict(
        softmax_scale=0.5, diag_offset=1, window_left=2, window_right=3, softcap=1.0, alibi_slopes=torch.zeros(H),
        dropout_p=0.1, seed=torch.zeros(1, dtype=torch.int64), sinks=torch.zeros(H),
    ),
    Varlen: dict(cu_seqlens_q=_int32(B + 2), cu_seqlens_k=_int32(B + 2), max_seqlen_q=SQ + 1, max_seqlen_k=SK + 1),
    KeyRanges: dict(start=_int32(B + 1), end=_int32(B + 1), max_len=SK + 1, table=_int32(B, 1)),
    Cache: dict(k=torch.zeros(B, SK + 1, HK, D), v=torch.zeros(B, SK + 1, HK, D), table=_int32(B, 2),
                seqlens=_int32(B + 1), leftpad=_int32(B)),
    Rotary: dict(cos=torch.zeros(SK + 1, D // 2), sin=torch.zeros(SK + 1, D // 2), interleaved=True),
    AttentionCall: dict(
        q=torch.zeros(B, SQ + 1, H, D), k=torch.zeros(B, SK + 1, HK, D), v=torch.zeros(B, SK + 1, HK, D),
        softmax_scale=0.5, causal=True, diag_offset=1, window=(2, 3), softcap=1.0, alibi_slopes=torch.zeros(H),
        attn_mask=torch.zeros(1, 1, SQ, SK), dropout_p=0.1, return_lse=True, return_probs=True,
        cu_seqlens_q=_int32(B + 1), cu_seqlens_k=_int32(B + 1), max_seqlen_q=SQ, max_seqlen_k=SK,
        seed=torch.zeros(1, dtype=torch.int64), sinks=torch.zeros(H), deterministic=True,
    ),
    FlashOptions: dict(
        dropout_p=0.1, softmax_scale=0.5, causal=True, window_size=(2, 2), softcap=1.0, alibi_slopes=torch.rand(H),
        deterministic=True, return_lse=True, return_probs=True, learnable_sink=torch.zeros(H),
    ),
}  # fmt: skip
FIELDS = {
    ScoreOptions: SCORE_FIELDS,
    Varlen: VARLEN_FIELDS,
    KeyRanges: KEY_RANGE_FIELDS,
    Cache: kvcache._CACHE_FIELDS,
    Rotary: kvcache._ROTARY_FIELDS,
    AttentionCall: CALL_FIELDS,
    FlashOptions: call_builder._OPTION_FIELDS,
}


def _names(record: Any) -> list:
    """Every field of a record type: a NamedTuple's, or a dataclass's but those outside its equality."""
    if dataclasses.is_dataclass(record):
        return [f.name for f in dataclasses.fields(record) if f.compare]
    return list(record._fields)


def _changed(record: Any, name: str) -> Any:
    """``record`` with field ``name`` set to its variant."""
    value = VARIANTS[type(record)][name]
    if isinstance(record, tuple):  # a NamedTuple
        return record._replace(**{name: value})  # type: ignore[attr-defined]
    return dataclasses.replace(record, **{name: value})


def _cases(*records) -> list:
    """``(record, field name)`` for every field of each record, with readable ids."""
    return [pytest.param(r, name, id=f"{type(r).__name__}.{name}") for r in records for name in _names(type(r))]


@pytest.mark.parametrize("record", list(FIELDS), ids=lambda r: r.__name__)
def test_fields_split_every_field(record):
    fields = FIELDS[record]
    assert sorted(fields.tensors + fields.values) == sorted(_names(record))
    assert not set(fields.tensors) & set(fields.values)
    example = dict(VARIANTS[record])
    assert all(isinstance(example[name], torch.Tensor) for name in fields.tensors)
    assert not any(isinstance(example[name], torch.Tensor) for name in fields.values)
    assert Fields(record).tensors == fields.tensors  # derived, the same every time


@pytest.mark.parametrize("record", list(FIELDS), ids=lambda r: r.__name__)
def test_every_field_has_a_variant(record):
    assert sorted(VARIANTS[record]) == sorted(_names(record)), "give each new field a variant in VARIANTS"


def test_fields_of_one_or_no_field():
    """``attrgetter`` returns a bare value for one name and takes none: the getters still return tuples."""
    assert kvcache._ROTARY_FIELDS.values_of(ROTARY) == (False,)
    assert kvcache._CACHE_FIELDS.values_of(CACHE) == ()
    assert VARLEN_FIELDS.tensors_of(VARLEN) == (VARLEN.cu_seqlens_q, VARLEN.cu_seqlens_k)


def _forward_key(options=OPTIONS, varlen=None, keys=None):
    q, k, v = _tensors()
    if varlen is not None:  # packed: (total, heads, D), as attention_forward takes them
        q, k, v = torch.zeros(B * SQ, H, D), torch.zeros(B * SK, HK, D), torch.zeros(B * SK, HK, D)
    return forward._plan_key(q, k, v, options, varlen, keys, 1, "fwd", None)


@pytest.mark.parametrize("record,name", _cases(OPTIONS, VARLEN, KEYS))
def test_forward_key_reads_every_field(record, name):
    parts = dict(options=OPTIONS, varlen=VARLEN, keys=KEYS)
    slot = {ScoreOptions: "options", Varlen: "varlen", KeyRanges: "keys"}[type(record)]
    assert _forward_key(**parts) != _forward_key(**{**parts, slot: _changed(record, name)})
    if slot == "options":  # a dense call (no key ranges) too
        assert _forward_key() != _forward_key(_changed(record, name))


def test_forward_keys_tell_which_records_a_call_has():
    """Dense, varlen (its key ranges follow from it), key ranges alone (a cache), both (paged varlen)."""
    found = [_forward_key(varlen=varlen, keys=keys) for varlen in (None, VARLEN) for keys in (None, KEYS)]
    assert None not in found and len(set(found)) == 4


def _backward_key(options=OPTIONS, varlen=None):
    q, k, v = _tensors()
    return backward_launch._plan_key(q, q, k, v, q, torch.zeros(B, H, SQ), options, varlen, True, False)


@pytest.mark.parametrize("record,name", _cases(OPTIONS, VARLEN))
def test_backward_key_reads_every_field(record, name):
    if isinstance(record, Varlen):
        assert _backward_key(varlen=VARLEN) != _backward_key(varlen=_changed(record, name))
    else:
        assert _backward_key() != _backward_key(_changed(record, name))
        assert _backward_key(varlen=VARLEN) != _backward_key(_changed(record, name), VARLEN)


def _step_key(options=OPTIONS, cache=CACHE, rotary=ROTARY):
    q = torch.zeros(B, 1, H, D)
    return kvcache._step_key(q, None, None, cache, rotary, options, 0, None)


@pytest.mark.parametrize("record,name", _cases(OPTIONS, CACHE, ROTARY))
def test_kvcache_key_reads_every_field(record, name):
    slot = {ScoreOptions: "options", Cache: "cache", Rotary: "rotary"}[type(record)]
    assert _step_key() != _step_key(**{slot: _changed(record, name)})
    if slot == "options":  # a step without rotary too
        assert _step_key(rotary=None) != _step_key(_changed(record, name), rotary=None)


@pytest.mark.parametrize("record,name", _cases(CALL))
def test_selection_key_reads_every_field(record, name):
    assert dispatch._selection_key(CALL, None, None) != dispatch._selection_key(_changed(CALL, name), None, None)


@pytest.mark.parametrize("record,name", _cases(FLASH))
def test_flash_call_key_reads_every_field(record, name):
    q, k, v = _tensors()
    names = ("q", "k", "v")
    key = call_builder._call_key(q, k, v, FLASH, names, None, False)
    assert key != call_builder._call_key(q, k, v, _changed(FLASH, name), names, None, False)


def _entries(memo_owner, memo_name: str, monkeypatch, run, baseline, fields) -> None:
    """Run ``run(record)`` for ``baseline``, once per field changed, then ``baseline`` again; each
    changed field must add one entry to the memo ``memo_owner.memo_name`` (the repeat adds none)."""
    memo = Memo()
    monkeypatch.setattr(memo_owner, memo_name, memo)
    run(baseline)
    for count, name in enumerate(fields, start=2):
        run(_changed(baseline, name))
        assert len(memo) == count, f"a call with another {name} reused a memo entry"
    run(baseline)
    assert len(memo) == len(fields) + 1, "the same call again took a new entry"


_NO_PLAN = ForwardPlan(
    out_shape=(), lse_shape=(), main=None, combine=None, num_splits=1, tma=(), tuned=(), warp_spec=()
)


def test_forward_memo_entry_per_option(monkeypatch):
    planned = []
    monkeypatch.setattr(forward, "plan_forward", lambda *args: planned.append(args[3]) or _NO_PLAN)
    monkeypatch.setattr(forward, "run_forward", lambda *args: (None, None))
    q, k, v = _tensors()
    _entries(forward, "_PLANS", monkeypatch, lambda o: forward.attention_forward(q, k, v, o), OPTIONS,
             ScoreOptions._fields)  # fmt: skip
    assert len(planned) == len(ScoreOptions._fields) + 1  # one plan per entry


def test_a_public_calls_forward_plan_is_keyed_by_its_token(monkeypatch):
    """Through the public layer, a forward plan's key is the call's token (``memo_keys.TOKENS``)
    in place of a signature of its tensors and options (``attention_forward``'s ``signed``): two
    flash-attn calls differing only in one option get two plans, the same call again reuses its
    plan, and no plan key computes a signature on the way."""
    planned = []
    monkeypatch.setattr(forward, "plan_forward", lambda *args: planned.append(args[3]) or _NO_PLAN)
    monkeypatch.setattr(forward, "run_forward", lambda *args: (None, None))

    def no_signature(*args):
        raise AssertionError("a signed call's forward plan key computed a signature")

    monkeypatch.setattr(forward, "signature", no_signature)
    q, k, v = _tensors()
    backend = dispatch._BY_NAME["triton"]

    def run(options):
        call = call_builder.build_flash_call(q, k, v, options)
        assert call.signature is not None  # signed: what the plan key stands on
        backend.run(call)

    _entries(forward, "_PLANS", monkeypatch, run, FLASH, _names(FlashOptions))
    assert len(planned) == len(_names(FlashOptions)) + 1
    # A call of another layout is another signature: another token, another plan.
    transposed = torch.zeros(B, H, SQ, D).transpose(1, 2)
    before = len(planned)
    backend.run(call_builder.build_flash_call(transposed, k, v, FLASH))
    assert len(planned) == before + 1


def test_backward_memo_entry_per_option(monkeypatch):
    planned = []
    monkeypatch.setattr(backward_launch, "plan_backward", lambda *args: planned.append(args[6]) or _NO_PLAN)
    monkeypatch.setattr(backward_launch, "run_backward", lambda *args: (None, None, None, None))
    q, k, v = _tensors()
    lse = torch.zeros(B, H, SQ)

    def run(options):
        backward_launch.attention_backward(q, q, k, v, q, lse, options)

    _entries(backward_launch, "_PLANS", monkeypatch, run, OPTIONS, ScoreOptions._fields)
    assert len(planned) == len(ScoreOptions._fields) + 1


def test_kvcache_memo_entry_per_option(monkeypatch):
    planned = []
    step = StepPlan(append=None, rotate_q=None, forward=_NO_PLAN)
    monkeypatch.setattr(kvcache, "_plan_step", lambda *args: planned.append(args[5]) or step)
    monkeypatch.setattr(kvcache, "run_forward", lambda *args: (None, None))
    q = torch.zeros(B, 1, H, D)
    _entries(kvcache, "_STEPS", monkeypatch, lambda o: kvcache.attention_kvcache(q, None, None, CACHE, None, o),
             OPTIONS, ScoreOptions._fields)  # fmt: skip
    assert len(planned) == len(ScoreOptions._fields) + 1


def test_a_public_cache_calls_step_plan_is_keyed_by_its_token(monkeypatch):
    """Through the public layer, a decoding step's key is the call's token in place of a signature
    of its tensors and records (``attention_kvcache``'s ``signed``): calls differing only in one
    argument get two step plans, the same call again reuses its plan, and no step key computes a
    signature on the way."""
    planned = []
    step = StepPlan(append=None, rotate_q=None, forward=_NO_PLAN)
    monkeypatch.setattr(kvcache, "_plan_step", lambda *args: planned.append(args[5]) or step)
    monkeypatch.setattr(kvcache, "run_forward", lambda *args: (None, None))

    def no_signature(*args):
        raise AssertionError("a signed call's step key computed a signature")

    monkeypatch.setattr(kvcache, "signature", no_signature)
    defaults = {
        name: p.default
        for name, p in inspect.signature(flash_recipe.flash_attn_with_kvcache).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    q, k_cache, v_cache = torch.zeros(B, 1, H, D), torch.zeros(B, SK, HK, D), torch.zeros(B, SK, HK, D)
    baseline = dict(defaults, cache_seqlens=3)
    variants = [dict(causal=True), dict(softmax_scale=0.5), dict(window_size=(2, 0)), dict(softcap=1.0),
                dict(num_splits=2), dict(return_softmax_lse=True), dict(cache_seqlens=4),
                dict(alibi_slopes=torch.zeros(H)), dict(learnable_sink=torch.zeros(H))]  # fmt: skip
    backend = dispatch._BY_NAME["triton"]

    def run(args):
        call = decoding.build_cache_call(q, k_cache, v_cache, **args)
        assert call.attention.signature is not None  # signed: what the step key stands on
        backend.run_cache(call)

    memo = Memo()
    monkeypatch.setattr(kvcache, "_STEPS", memo)
    run(baseline)
    for count, changed in enumerate(variants, start=2):
        run(dict(baseline, **changed))
        assert len(memo) == count, f"a call with another {changed} reused a step plan"
    run(baseline)
    assert len(memo) == len(planned) == len(variants) + 1


def test_selection_memo_entry_per_field(monkeypatch):
    chosen = []
    monkeypatch.setattr(dispatch, "_choose", lambda call, name, extra: chosen.append(call) or dispatch.BACKENDS[-1])
    _entries(dispatch, "_SELECTED", monkeypatch, dispatch.select, CALL, _names(AttentionCall))
    assert len(chosen) == len(_names(AttentionCall)) + 1


def test_flash_call_memo_entry_per_option(monkeypatch):
    q, k, v = _tensors()
    calls = []

    def run(options):
        calls.append(call_builder.build_flash_call(q, k, v, options))

    _entries(call_builder, "_CALLS", monkeypatch, run, FLASH, _names(FlashOptions))
    assert calls[-1].signature == calls[0].signature  # the repeat reused the first call's entry
