"""gpt-oss on the transformers integration: attention sinks (``s_aux``) reach the kernels.

A tiny random ``GptOssForCausalLM`` (layer 0 a sliding window of 4, layer 1 full attention; 4
query heads over 2 kv heads; a sink per head, spread from -3 to 2.5 so that each head's sink takes
a different share) gives the logits, every gradient (the sinks' included) and the greedy tokens of
transformers' own ``eager`` attention (gpt-oss has no ``sdpa`` path). The truth is ``eager`` in
float64; the allowed error is 2x (forward) or 3x (gradients) the error of ``eager`` in float32,
plus 1e-5 (``flash_recipe.testing``'s rule). torch SDPA has no sinks, so on a CPU flash_recipe
runs them on its reference backend; the Triton kernels run through the interpreter, in float32
(the interpreter computes bfloat16 dots wrongly).

The model has two experts and routes every token to both: the routing then makes no discrete
choice that float32 and float64 could make differently.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip("this transformers has no gpt-oss model", allow_module_level=True)

import flash_recipe  # noqa: E402
from flash_recipe.integrations import transformers as fr_transformers  # noqa: E402
from flash_recipe.testing import assert_accurate  # noqa: E402

NAME = fr_transformers.ATTN_IMPLEMENTATION
VOCAB, PAD, HEADS, WINDOW = 97, 0, 4, 4
BACKENDS = ["reference", "triton"]  # torch SDPA cannot take sinks
SINKS = ([-3.0, -0.5, 1.0, 2.5], [2.0, 0.5, -1.0, -2.5])  # per layer, per query head


@pytest.fixture
def form(request, monkeypatch):
    """``static``: the shape-static forms the integration takes under torch.compile, run uncompiled."""
    if request.param == "static":
        monkeypatch.setattr(fr_transformers, "_static_shapes", lambda: True)
    return request.param


def _config():
    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=2,
        initializer_range=0.1,  # scores of a few units: peaked attention, not a uniform average
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=PAD,
        eos_token_id=None,
        bos_token_id=None,
    )


_WEIGHTS: dict = {}


def _models(device):
    """``(flash_recipe fp32, eager fp32, eager fp64)`` copies of one random model.

    ``experts_implementation="batched_mm"``: the default (``grouped_mm``) has no float64 kernel, and
    ``eager`` (a loop over the experts hit) breaks a compiled graph at a ``nonzero``."""
    fr_transformers.register()
    models = []
    for impl, dtype in ((NAME, torch.float32), ("eager", torch.float32), ("eager", torch.float64)):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                _config(), attn_implementation=impl, experts_implementation="batched_mm"
            )
        if not _WEIGHTS:
            weights = copy.deepcopy(model.state_dict())
            for layer, sinks in enumerate(SINKS):
                weights[f"model.layers.{layer}.self_attn.sinks"] = torch.tensor(sinks)
            _WEIGHTS.update(weights)
        model.load_state_dict(_WEIGHTS)
        models.append(model.to(device=device, dtype=dtype).eval())
    assert models[0].config._attn_implementation == NAME
    assert [layer.self_attn.sliding_window for layer in models[0].model.layers] == [WINDOW, None]
    return models


def _inputs(device, seqlen: int, batch: int = 2):
    """Token ids and a 2D mask: row 0 starts with 3 pad tokens, the others are all real."""
    ids = torch.randint(1, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return ids.to(device), mask.to(device)


def _check_rule(name: str, got, same, truth, factor: int, keep=None) -> None:
    if keep is not None:
        got, same, truth = got[keep], same[keep], truth[keep]
    assert_accurate(name, got, truth, same, factor)


@pytest.mark.parametrize("form", ["eager", "static"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_match_eager(backend, form, device):
    """A training step on a batch with a left-padded row (the varlen path; in the static form, the
    compile form): the logits of the real tokens and every parameter's gradient, each layer's
    sinks included, by the rule."""
    models = _models(device)
    ids, mask = _inputs(device, seqlen=9)
    labels = ids.masked_fill(mask == 0, -100)
    logits = []
    for i, model in enumerate(models):
        model.train()
        with flash_recipe.use_backend(backend if i == 0 else None):
            out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        logits.append(out.logits.detach())
    _check_rule("logits", logits[0], logits[1], logits[2], 2, keep=mask.bool())
    named = [dict(model.named_parameters()) for model in models]
    sinks = [name for name in named[0] if name.endswith("self_attn.sinks")]
    assert len(sinks) == 2 and all(named[0][name].grad.abs().min() > 0 for name in sinks)
    for name, param in named[0].items():
        _check_rule(f"grad of {name}", param.grad, named[1][name].grad, named[2][name].grad.double(), 3)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_matches_eager(backend, cache, device):
    """Greedy generation from a left-padded batch: the same tokens, and each step's logits by the
    rule. The decode steps have one query against a longer cache; the window layer's cache
    outgrows its window; a static cache holds empty slots after the tokens seen so far."""
    ours, same, truth = _models(device)
    ids, mask = _inputs(device, seqlen=6)
    options = dict(
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=PAD,
        cache_implementation=None if cache == "dynamic" else "static",
    )
    with torch.no_grad():
        with flash_recipe.use_backend(backend):
            got = ours.generate(ids, **options)
        want = truth.generate(ids, **options)
        base = same.generate(ids, **options)
    assert torch.equal(base.sequences, want.sequences)  # the test's own premise: no near-ties
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w, s) in enumerate(zip(got.logits, want.logits, base.logits)):
        _check_rule(f"logits of step {step}", g, s, w, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_match_eager(backend, device):
    """Two sequences packed in one row stay apart with their sinks, whether the packing is found
    from ``position_ids`` (positions restart) or given as ``cu_seq_lens_*`` / ``max_length_*``. The
    truth runs each sequence alone (gpt-oss's own mask does not read ``position_ids``, so ``eager``
    would let the second sequence attend to the first)."""
    ours, same, truth = _models(device)
    ids, _ = _inputs(device, seqlen=13, batch=1)
    position_ids = torch.tensor([[*range(6), *range(7)]], device=device)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32, device=device)
    given = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    with torch.no_grad():
        want, base = (torch.cat([m(ids[:, :6]).logits, m(ids[:, 6:]).logits], dim=1) for m in (truth, same))
        with flash_recipe.use_backend(backend):
            for extra in ({}, given):
                got = ours(ids, position_ids=position_ids, use_cache=False, **extra).logits
                _check_rule(f"logits ({sorted(extra) or 'position_ids'})", got, base, want, 2)


def test_compiled_training_step_runs_in_one_graph_and_matches(device):
    """``torch.compile(model, fullgraph=True)`` (Dynamo and AOTAutograd, ``backend="aot_eager"``)
    of a training step on the padded batch: one graph, the sinks' custom op and its backward traced;
    the logits of the real tokens and every gradient by the rule."""
    models = _models(device)
    ids, mask = _inputs(device, seqlen=9)
    labels = ids.masked_fill(mask == 0, -100)
    torch._dynamo.reset()
    runs = [torch.compile(models[0], backend="aot_eager", fullgraph=True), models[1], models[2]]
    logits = []
    for i, (model, run) in enumerate(zip(models, runs)):
        model.train()
        with flash_recipe.use_backend("triton" if i == 0 else None):
            out = run(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        logits.append(out.logits.detach())
    _check_rule("logits", logits[0], logits[1], logits[2], 2, keep=mask.bool())
    named = [dict(model.named_parameters()) for model in models]
    for name, param in named[0].items():
        _check_rule(f"grad of {name}", param.grad, named[1][name].grad, named[2][name].grad.double(), 3)


def _eager_with_sinks(query, key, value, mask4d, sinks):
    """transformers' own gpt-oss eager attention, ``(batch, seqlen_q, nheads, headdim)``."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(sinks=sinks, num_key_value_groups=query.shape[1] // key.shape[1], training=False)
    additive = torch.zeros(mask4d.shape, dtype=query.dtype, device=query.device)
    additive = additive.masked_fill(~mask4d, torch.finfo(query.dtype).min)
    return eager_attention_forward(module, query, key, value, additive, scaling=query.shape[-1] ** -0.5)[0]


def test_4d_mask_from_the_caller_takes_the_sinks(device):
    """A ready-made 4D mask (causal + padding, True = attend) goes through
    ``flash_recipe.scaled_dot_product_attention`` with the sinks: output and the sinks' gradient
    by the rule against transformers' gpt-oss eager attention."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, HEADS, 7, 16, generator=gen, dtype=torch.float64).to(device)
    k, v = (torch.randn(2, 2, 7, 16, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    padding = torch.ones(2, 7, dtype=torch.bool, device=device)
    padding[0, :2] = False
    mask4d = (torch.ones(7, 7, dtype=torch.bool, device=device).tril()[None] & padding[:, None, :])[:, None]
    dout = torch.randn(2, 7, HEADS, 16, generator=gen, dtype=torch.float64).to(device)
    results = []
    for dtype, ours in ((torch.float32, True), (torch.float32, False), (torch.float64, False)):
        sinks = torch.tensor(SINKS[0], dtype=dtype, device=device, requires_grad=True)
        args = [t.to(dtype) for t in (q, k, v)]
        if ours:
            out = fr_transformers.attention_forward(SimpleNamespace(is_causal=True), *args, mask4d, s_aux=sinks)[0]
        else:
            out = _eager_with_sinks(*args, mask4d, sinks)
        (out * dout.to(dtype)).sum().backward()
        results.append((out.detach(), sinks.grad))
    (got, dgot), (base, dbase), (want, dwant) = results
    _check_rule("out", got, base, want, 2)  # row 0's first 2 queries see no key: 0 in eager too
    _check_rule("grad of the sinks", dgot, dbase, dwant, 3)


def test_sinks_of_the_wrong_shape_are_refused(device):
    """One sink per query head, or a ValueError that names the argument."""
    q = torch.randn(1, HEADS, 5, 16, device=device)
    k = v = torch.randn(1, 2, 5, 16, device=device)
    with pytest.raises(ValueError, match=r"s_aux must have shape \(nheads,\) = \(4,\)"):
        fr_transformers.attention_forward(SimpleNamespace(is_causal=True), q, k, v, None, s_aux=torch.zeros(2))
