"""The FlashAttention-3 stand-in (``install_as_flash_attn_3()``): FA3 3.0.0's functions by its
signatures, checked by the accuracy rule against fp32 math; what it refuses, by name; how FA3's
callers find it (``importlib.metadata``, the three top-level modules); and transformers'
``flash_attention_3`` on a tiny Llama (``fa3_clients.py``, in its own process)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rule_checks import SCALE, check, tensors, truths

from flash_recipe.flash_attn_3 import flash_attn_interface as fa3

UNSET = inspect.Parameter.empty

# FA3 3.0.0's public functions (Dao-AILab/flash-attention, hopper/flash_attn_interface.py):
# every parameter in order, with its default (UNSET: none).
FA3_SIGNATURES = {
    "flash_attn_func": [
        ("q", UNSET), ("k", UNSET), ("v", UNSET), ("softmax_scale", None), ("causal", False), ("qv", None),
        ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
        ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None), ("deterministic", False),
        ("sm_margin", 0), ("return_attn_probs", False),
    ],
    "flash_attn_varlen_func": [
        ("q", UNSET), ("k", UNSET), ("v", UNSET), ("cu_seqlens_q", UNSET), ("cu_seqlens_k", UNSET),
        ("max_seqlen_q", UNSET), ("max_seqlen_k", UNSET), ("seqused_q", None), ("seqused_k", None),
        ("softmax_scale", None), ("causal", False), ("qv", None), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1),
        ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False),
    ],
    "flash_attn_qkvpacked_func": [
        ("qkv", UNSET), ("softmax_scale", None), ("causal", False), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
        ("deterministic", False), ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False),
    ],
    "flash_attn_with_kvcache": [
        ("q", UNSET), ("k_cache", UNSET), ("v_cache", UNSET), ("k", None), ("v", None), ("qv", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("page_table", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None),
        ("max_seqlen_q", None), ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("attention_chunk", 0), ("softcap", 0.0), ("rotary_interleaved", True), ("scheduler_metadata", None),
        ("num_splits", 0), ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False),
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_each_function_takes_fa3s_arguments_in_fa3s_order(name):
    """FA3's parameters, positions and defaults, then only the keyword-only ``s_aux`` (vLLM's name
    for the sinks, which transformers looks for)."""
    parameters = list(inspect.signature(getattr(fa3, name)).parameters.values())
    ours = [(p.name, p.default) for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert ours == FA3_SIGNATURES[name]
    assert [(p.name, p.kind, p.default) for p in parameters[len(ours) :]] == [
        ("s_aux", inspect.Parameter.KEYWORD_ONLY, None)
    ]
    assert sorted(fa3.__all__) == sorted(FA3_SIGNATURES)


def _grads(out, dout, leaves):
    out.backward(dout)
    return {name: t.grad for name, t in zip(("dq", "dk", "dv"), leaves)}


def test_dense_calls_by_position_and_by_keyword_meet_the_rule():
    """GQA, causal with a window, forward and backward; FA3's 4th positional is ``softmax_scale``."""
    q, k, v, dout = tensors((2, 19, 4, 32), (2, 23, 2, 32))
    truth, same = truths(q, k, v, dout, causal=True, window=(7, 0))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa3.flash_attn_func(*leaves, SCALE, True, None, None, None, None, (7, -1))
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    check({"out": out.detach(), **_grads(out, dout, leaves)}, truth, same)
    out, lse = fa3.flash_attn_func(
        q, k, v, softmax_scale=SCALE, causal=True, window_size=(7, -1), num_splits=3, pack_gqa=True, sm_margin=4,
        deterministic=True, return_attn_probs=True,
    )  # fmt: skip
    assert lse.shape == (2, 4, 19) and lse.dtype == torch.float32
    check({"out": out, "lse": lse}, truth, same)


def test_sinks_as_s_aux_meet_the_rule():
    q, k, v, dout = tensors((1, 13, 4, 16), (1, 13, 4, 16), seed=3)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    truth, same = truths(q, k, v, dout, causal=True, sinks=sinks)
    out, lse = fa3.flash_attn_func(q, k, v, SCALE, True, return_attn_probs=True, s_aux=sinks)
    check({"out": out, "lse": lse}, truth, same)


@pytest.mark.parametrize("layout", ["3-stacked", "heads-split"])
def test_packed_qkv_in_both_of_fa3s_layouts(layout):
    q, k, v, dout = tensors((2, 17, 2, 16), (2, 17, 2, 16), seed=1)
    truth, same = truths(q, k, v, dout)
    if layout == "3-stacked":
        qkv = torch.stack([q, k, v], dim=2).requires_grad_()
        out = fa3.flash_attn_qkvpacked_func(qkv, SCALE)
        out.backward(dout)
        dq, dk, dv = qkv.grad.unbind(dim=2)
    else:
        qkv = torch.cat([q, k, v], dim=2).requires_grad_()
        out = fa3.flash_attn_qkvpacked_func(qkv, SCALE, num_heads_q=2)
        out.backward(dout)
        dq, dk, dv = qkv.grad.split([2, 2, 2], dim=2)
    check({"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}, truth, same)
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(torch.cat([q, k, v], dim=2), num_heads_q=3)


def test_varlen_with_seqused_uses_only_the_first_rows_of_each_sequence():
    """Two packed sequences (11 and 14 queries, 9 and 16 keys); ``seqused_q`` keeps 6 and 14,
    ``seqused_k`` 9 and 14. The kept rows meet the rule against each sequence's own attention;
    the others output 0 with lse +inf and get zero gradients."""
    q, k, v, dout = tensors((25, 4, 16), (25, 2, 16), seed=2)
    cu_q, cu_k = torch.tensor([0, 11, 25], dtype=torch.int32), torch.tensor([0, 9, 25], dtype=torch.int32)
    used_q, used_k = torch.tensor([6, 14], dtype=torch.int32), torch.tensor([9, 14], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa3.flash_attn_varlen_func(
        *leaves, cu_q, cu_k, 14, 16, used_q, used_k, SCALE, True, return_attn_probs=True
    )
    grads = _grads(out, dout, leaves)
    assert out.shape == q.shape and lse.shape == (4, 25)
    kept_q, kept_k = [], []
    for b in range(2):
        rows = slice(int(cu_q[b]), int(cu_q[b]) + int(used_q[b]))
        keys = slice(int(cu_k[b]), int(cu_k[b]) + int(used_k[b]))
        kept_q += list(range(rows.start, rows.stop))
        kept_k += list(range(keys.start, keys.stop))
        truth, same = truths(q[rows][None], k[keys][None], v[keys][None], dout[rows][None], causal=True)
        got = {"out": out[rows][None].detach(), "lse": lse[:, rows][None].detach(), "dq": grads["dq"][rows][None],
               "dk": grads["dk"][keys][None], "dv": grads["dv"][keys][None]}  # fmt: skip
        check(got, truth, same)
    unused_q = [i for i in range(25) if i not in kept_q]
    unused_k = [i for i in range(25) if i not in kept_k]
    assert unused_q and unused_k
    assert torch.all(out[unused_q] == 0) and torch.all(lse[:, unused_q] == float("inf"))
    assert torch.all(grads["dq"][unused_q] == 0) and torch.all(grads["dk"][unused_k] == 0)
    with pytest.raises(ValueError, match="seqused_k must be in"):
        fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 14, 16, seqused_k=torch.tensor([10, 3], dtype=torch.int32))


def test_kvcache_with_a_page_table_appends_and_meets_the_rule():
    """Decode 1 new token per sequence over a paged cache (pages of 16 rows), FA3's ``page_table``
    and ``return_softmax_lse``; the new keys are written into the cache."""
    gen = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, dim, page = 2, 4, 2, 16, 16
    lengths = [21, 9]
    k_cache = torch.zeros(5, page, kv_heads, dim, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    page_table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    history_k = [torch.randn(n, kv_heads, dim, generator=gen).half() for n in lengths]
    history_v = [torch.randn(n, kv_heads, dim, generator=gen).half() for n in lengths]
    for b, n in enumerate(lengths):
        for j in range(n):
            k_cache[page_table[b, j // page], j % page] = history_k[b][j]
            v_cache[page_table[b, j // page], j % page] = history_v[b][j]
    q = torch.randn(batch, 1, heads, dim, generator=gen).half()
    k_new = torch.randn(batch, 1, kv_heads, dim, generator=gen).half()
    v_new = torch.randn(batch, 1, kv_heads, dim, generator=gen).half()
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, page_table=page_table, softmax_scale=SCALE,
        causal=True, num_splits=0, scheduler_metadata=torch.zeros(1, dtype=torch.int32), return_softmax_lse=True,
    )  # fmt: skip
    for b, n in enumerate(lengths):
        keys = torch.cat([history_k[b], k_new[b]])[None]
        values = torch.cat([history_v[b], v_new[b]])[None]
        assert torch.equal(k_cache[page_table[b, n // page], n % page], k_new[b, 0])
        truth, same = truths(q[b : b + 1], keys, values, torch.zeros_like(q[b : b + 1]), causal=True)
        check({"out": out[b : b + 1], "lse": lse[b : b + 1]}, truth, same)


@pytest.mark.parametrize(
    "call, match, error",
    [
        (lambda q: fa3.flash_attn_func(q, q, q, qv=q), "qv:", NotImplementedError),
        (lambda q: fa3.flash_attn_func(q, q, q, q_descale=torch.ones(1)), "q_descale: FP8", NotImplementedError),
        (lambda q: fa3.flash_attn_func(q, q, q, v_descale=torch.ones(1)), "v_descale: FP8", NotImplementedError),
        (lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=8), "attention_chunk: chunked", NotImplementedError),
        (lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=-1), "attention_chunk must be >= 0", ValueError),
        (lambda q: fa3.flash_attn_func(q, q, q, num_splits=1.5), "num_splits must be an int", TypeError),
        (lambda q: fa3.flash_attn_func(q, q, q, pack_gqa="yes"), "pack_gqa", TypeError),
        (lambda q: fa3.flash_attn_func(q, q, q, return_attn_probs=1), "return_attn_probs", TypeError),
        (
            lambda q: fa3.flash_attn_with_kvcache(q, q, q, cu_seqlens_q=torch.zeros(2, dtype=torch.int32)),
            "cu_seqlens_q: packed queries",
            NotImplementedError,
        ),
        (lambda q: fa3.flash_attn_with_kvcache(q, q, q, scheduler_metadata=[1]), "scheduler_metadata", TypeError),
    ],
    ids=["qv", "q_descale", "v_descale", "chunk", "chunk-negative", "num_splits", "pack_gqa", "probs", "cu_q", "meta"],
)
def test_what_the_stand_in_cannot_compute_is_refused_by_name(call, match, error):
    with pytest.raises(error, match=match):
        call(torch.randn(1, 8, 2, 16, dtype=torch.float16))


CHECK = """
import importlib.metadata as md, importlib.util, json, sys, torch
import flash_recipe
from flash_recipe.alias import is_installed
assert flash_recipe.install_as_flash_attn_3(beta_returns=BETA)
import flash_attn_3, flash_attn_config, flash_attn_interface
from flash_attn_3 import flash_attn_interface as inner
q = torch.randn(1, 8, 2, 16, dtype=torch.float16)
result = flash_attn_interface.flash_attn_func(q, q, q)
try:
    flash_attn_interface.flash_attn_combine
    missing = None
except AttributeError as exc:
    missing = str(exc)
print(json.dumps({
    "found": [importlib.util.find_spec(n) is not None
              for n in ("flash_attn_3", "flash_attn_interface", "flash_attn_config")],
    "same": inner is flash_attn_interface,
    "versions": [md.version(n) for n in ("flash_attn_3", "flash-attn-3")] + [flash_attn_3.__version__],
    "owners": md.packages_distributions().get("flash_attn_interface"),
    "installed": is_installed("flash_attn_3"),
    "fa2": is_installed("flash_attn"),
    "tuple": isinstance(result, tuple),
    "fp8_off": flash_attn_config.CONFIG["build_flags"]["FLASHATTENTION_DISABLE_FP8"],
    "hdim256_off": flash_attn_config.CONFIG["build_flags"]["FLASHATTENTION_DISABLE_HDIM256"],
    "missing": missing,
    "probe": importlib.util.find_spec("flash_attn_3._C"),
}))
"""


@pytest.mark.parametrize("beta", [False, True], ids=["3.0.0-returns", "beta-returns"])
def test_fa3s_callers_find_it_as_they_look_for_it(beta):
    """transformers 5.x: ``find_spec("flash_attn_interface")`` and "flash-attn-3" among its
    distributions; transformers 4.57 and diffusers: ``find_spec("flash_attn_3")`` and
    ``version("flash_attn_3")``. ``beta_returns=True`` gives the pre-2025-07 tuple."""
    proc = subprocess.run(
        [sys.executable, "-c", CHECK.replace("BETA", str(beta))], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = answer.pop("missing")
    assert answer == {
        "found": [True, True, True],
        "same": True,
        "versions": ["3.0.0"] * 3,
        "owners": ["flash-attn-3"],
        "installed": True,
        "fa2": False,
        "tuple": beta,
        "fp8_off": True,
        "hdim256_off": False,
        "probe": None,  # xformers probes for FA3's compiled module
    }
    assert "flash_attn_combine" in missing and "flash_attn_varlen_func" in missing


def test_transformers_flash_attention_3_on_a_tiny_llama():
    """``attn_implementation="flash_attention_3"``: padded (varlen) and unpadded (dense) logits by
    the rule against sdpa, and greedy generation with the KV cache token for token
    (``fa3_clients.transformers_client``; the CUDA check is the one stub, as it says)."""
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fa3_clients.py")), "transformers"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["loaded"] == "flash_attention_3"
    assert answer["calls"]["varlen"] == 2 and answer["calls"]["dense"] == 2 + 2 * 6  # 2 layers; 6 decode steps
    assert answer["tokens"] == 11 + 6
