"""The transformers integration: tiny random models give the logits, gradients and generated
tokens of transformers' own attention implementations, by the accuracy rule.

The truth is the same model with transformers' own implementation (``sdpa``, or ``eager`` where
the model has no sdpa path) in float64; the allowed error is 2x (forward) or 3x (gradients) that
implementation's own float32 error, plus 1e-5. Each test runs on flash_recipe's fallback (SDPA, or
its reference where SDPA cannot softcap) and on its Triton kernels (through the interpreter on a
CPU machine).

``form``: ``eager`` is the integration as it runs uncompiled; ``static`` runs, uncompiled, the
shape-static forms it takes under torch.compile (so every case is checked in both without paying
for a compilation each). The ``compiled`` tests then compile models with torch.compile: Dynamo and
AOTAutograd (``backend="aot_eager"``, which checks the traced graph and its backward but runs
aten ops without generating code), one test with inductor.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash_recipe  # noqa: E402
from flash_recipe.integrations import transformers as fr_transformers  # noqa: E402
from flash_recipe.testing import assert_accurate  # noqa: E402

NAME = fr_transformers.ATTN_IMPLEMENTATION
VOCAB, SEQLEN, PAD = 97, 11, 0
BACKENDS = ["sdpa", "triton"]
FORMS = ["eager", "static"]


@pytest.fixture
def form(request, monkeypatch):
    """``static``: the integration takes its torch.compile forms (see the module docstring)."""
    if request.param == "static":
        monkeypatch.setattr(fr_transformers, "_static_shapes", lambda: True)
    return request.param


def _config(kind: str):
    """Two layers, hidden 64, 4 query heads over 2 kv heads (GQA), head dim 16."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=None,
        bos_token_id=None,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common), "sdpa"
    if kind == "mistral-window4":  # the window is shorter than the sequence
        return transformers.MistralConfig(sliding_window=4, **common), "sdpa"
    if kind == "gemma2-softcap":  # softcap 1.0 bends every score; layer 0 has a window of 5, layer 1 none
        config = transformers.Gemma2Config(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=5,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=None,
            **common,
        )
        return config, "eager"  # transformers' Gemma 2 has no sdpa path (no softcap there)
    raise ValueError(f"unknown model kind {kind!r}")


_WEIGHTS: dict = {}


def _models(kind: str, device, **overrides):
    """``(flash_recipe fp32, reference fp32, reference fp64)`` copies of one random model."""
    fr_transformers.register()
    config, reference = _config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    models = []
    for impl, dtype in ((NAME, torch.float32), (reference, torch.float32), (reference, torch.float64)):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        if kind not in _WEIGHTS:
            _WEIGHTS[kind] = copy.deepcopy(model.state_dict())
        model.load_state_dict(_WEIGHTS[kind])
        models.append(model.to(device=device, dtype=dtype).eval())
    assert models[0].config._attn_implementation == NAME
    return models


def _inputs(padding: str, device, batch: int = 2, seqlen: int = SEQLEN):
    """Token ids and a 2D mask; row 0 has 4 pad tokens, row 1 has 1 (if ``batch > 2``), the last none."""
    ids = torch.randint(1, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    if padding == "left":
        mask[0, :4] = 0
        mask[1:-1, :1] = 0
    elif padding == "right":
        mask[0, -4:] = 0
        mask[1:-1, -1:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return ids.to(device), mask.to(device)


def _logits_row_by_row(model, ids, mask):
    """Logits of each row's real tokens, run alone at the positions they hold in the padded batch
    (no padding reaches the model; NaN at the pad positions)."""
    out = torch.full((*ids.shape, VOCAB), float("nan"), dtype=model.dtype, device=ids.device)
    positions = torch.arange(ids.shape[1], device=ids.device)
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        out[b, keep] = model(ids[b : b + 1, keep], position_ids=positions[keep][None]).logits[0]
    return out


def _check_rule(name: str, got, same, truth, factor: int, keep=None) -> None:
    """The accuracy rule (``flash_recipe.testing``) over the entries ``keep`` selects."""
    if keep is not None:
        got, same, truth = got[keep], same[keep], truth[keep]
    assert_accurate(name, got, truth, same, factor)


# torch SDPA has no softcap: flash_recipe's CPU fallback for Gemma 2 is its reference backend.
MODEL_BACKENDS = [
    *((kind, backend) for kind in ("llama", "mistral-window4") for backend in BACKENDS),
    ("gemma2-softcap", "reference"),
    ("gemma2-softcap", "triton"),
]


@pytest.mark.parametrize("form", FORMS, indirect=True)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind, backend", MODEL_BACKENDS, ids=[f"{k}-{b}" for k, b in MODEL_BACKENDS])
def test_logits_match_by_accuracy_rule(kind, backend, padding, form, device):
    """Logits of every real token; padding goes through the varlen path, none through the dense one.

    The truth and its float32 counterpart run each row alone (transformers' eager attention in
    float64 turns fully padded query rows into NaN, and the next layer carries them into the real
    tokens).
    """
    ours, same, truth = _models(kind, device)
    ids, mask = _inputs(padding, device)
    with torch.no_grad():
        with flash_recipe.use_backend(backend):
            got = ours(ids, attention_mask=mask).logits
        want = _logits_row_by_row(truth, ids, mask)
        base = _logits_row_by_row(same, ids, mask)
    _check_rule("logits", got, base, want, 2, keep=mask.bool())


@pytest.mark.parametrize("form", FORMS, indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, padding", [("llama", "left"), ("llama", "none"), ("mistral-window4", "left")])
def test_generate_with_kv_cache_matches(kind, padding, backend, form, device):
    """Greedy generation: the same tokens, and per-step logits by the rule.

    The decode steps have seqlen_q = 1 against a longer cache (the bottom-right causal diagonal),
    through the varlen path with left padding and the dense one without; the window model's
    cache outgrows its window.
    """
    ours, same, truth = _models(kind, device)
    ids, mask = _inputs(padding, device, seqlen=6)
    options = dict(
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=PAD,
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
def test_packed_rows_from_position_ids(backend, device):
    """Two sequences packed in one row (positions restart, no mask, no cache) stay apart."""
    ours, same, truth = _models("llama", device)
    ids, _ = _inputs("none", device, batch=1, seqlen=13)
    position_ids = torch.tensor([[*range(6), *range(7)]], device=device)
    with torch.no_grad():
        with flash_recipe.use_backend(backend):
            got = ours(ids, position_ids=position_ids, use_cache=False).logits
        want = truth(ids, position_ids=position_ids, use_cache=False).logits
        base = same(ids, position_ids=position_ids, use_cache=False).logits
        alone = truth(ids[:, 6:], use_cache=False).logits
    torch.testing.assert_close(want[:, 6:], alone, rtol=0, atol=1e-12)  # the reference does separate them
    _check_rule("logits", got, base, want, 2)


@pytest.mark.parametrize("form", FORMS, indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
def test_training_gradients_match(backend, form, device):
    """A training step (left padding, the varlen path) gives every parameter's gradient by the rule."""
    models = _models("mistral-window4", device)
    ids, mask = _inputs("left", device)
    labels = ids.masked_fill(mask == 0, -100)
    for i, model in enumerate(models):
        model.train()
        with flash_recipe.use_backend(backend if i == 0 else None):
            model(ids, attention_mask=mask, labels=labels).loss.backward()
    named = [dict(model.named_parameters()) for model in models]
    for name, param in named[0].items():
        _check_rule(f"grad of {name}", param.grad, named[1][name].grad, named[2][name].grad.double(), 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_dropout_applies_in_training_only(backend, device):
    """The model's attention_dropout reaches the kernels in training (reproducibly from torch's seed,
    with a finite backward) and not in evaluation."""
    ours, _, _ = _models("llama", device, attention_dropout=0.25)
    ids, mask = _inputs("left", device)
    keep = mask.bool()
    with flash_recipe.use_backend(backend):
        evaluated = []
        with torch.no_grad():
            for seed in (1, 2):
                torch.manual_seed(seed)
                evaluated.append(ours(ids, attention_mask=mask).logits)
        ours.train()
        trained = []
        for _ in range(2):
            torch.manual_seed(1)
            logits = ours(ids, attention_mask=mask).logits
            logits[keep].sum().backward()
            trained.append(logits.detach())
    torch.testing.assert_close(evaluated[0][keep], evaluated[1][keep], rtol=0, atol=0)
    torch.testing.assert_close(trained[0][keep], trained[1][keep], rtol=0, atol=0)
    assert (trained[0] - evaluated[0])[keep].abs().max() > 1e-3, "dropout was not applied in training"
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)


def test_4d_mask_from_the_caller_is_honoured(device):
    """A ready-made 4D mask (here causal + padding, True = attend) reaches the attention as is."""
    ours, same, truth = _models("llama", device)
    ids, mask = _inputs("right", device)
    causal = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool, device=device).tril()
    mask4d = (causal[None] & mask.bool()[:, None, :])[:, None]  # (batch, 1, seqlen, seqlen)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask4d).logits
        want = truth(ids, attention_mask=mask4d).logits
        base = same(ids, attention_mask=mask4d).logits
    _check_rule("logits", got, base, want, 2, keep=mask.bool())


def test_output_attentions_is_refused_naming_eager(device):
    """The weights are never materialised: asking for them fails instead of returning nothing."""
    ours, _, _ = _models("llama", device)
    ids, mask = _inputs("none", device)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="output_attentions=True.*'eager'"):
        ours(ids, attention_mask=mask, output_attentions=True)


def test_register_refuses_names_transformers_reserves():
    with pytest.raises(ValueError, match=r"name must not contain 'flash'.*got 'flash_x'"):
        fr_transformers.register("flash_x")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        fr_transformers.register("")
    fr_transformers.register()
    fr_transformers.register()  # again: harmless


def test_register_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"pip install 'flash-recipe\[transformers\]'"):
        fr_transformers.register()


def test_importing_flash_recipe_does_not_import_transformers():
    code = (
        "import sys, flash_recipe, flash_recipe.integrations.transformers\n"
        "flash_recipe.flash_attn_func\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the attention function alone: padded rows, holes, decoding, cross-attention ----------------

ATTENTION_CASES = {  # seqlen_q, seqlen_k, causal
    "self": (9, 9, True),
    "decode": (2, 9, True),  # the queries are the last 2 of 9 cached tokens
    "cross": (5, 9, False),  # the mask covers the keys only
}


@pytest.mark.parametrize("form", FORMS, indirect=True)
@pytest.mark.parametrize("backend", ["sdpa", "reference", "triton"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_function_pads_queries_with_zeros(case, backend, form, device):
    """Row 0 is left-padded, row 1 has a hole (right padding followed by new tokens), row 2 is all
    real. Real queries attend to the real keys only, by the rule against the reference run on each
    row's real tokens; padded queries output exactly 0."""
    from types import SimpleNamespace

    from flash_recipe.reference import attention_reference

    seqlen_q, seqlen_k, causal = ATTENTION_CASES[case]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, seqlen_q, 16, generator=gen).to(device)  # (batch, heads, seqlen, dim), as models pass them
    k, v = (torch.randn(3, 2, seqlen_k, 16, generator=gen).to(device) for _ in range(2))
    mask = torch.ones(3, seqlen_k, dtype=torch.bool, device=device)
    mask[0, :3] = False
    mask[1, 4:6] = False
    with flash_recipe.use_backend(backend):
        out, weights = fr_transformers.attention_forward(SimpleNamespace(is_causal=causal), q, k, v, mask)
    assert weights is None and out.shape == (3, seqlen_q, 4, 16)
    real_q = mask[:, -seqlen_q:] if causal else torch.ones(3, seqlen_q, dtype=torch.bool, device=device)
    assert torch.equal(out[~real_q], torch.zeros_like(out[~real_q]))
    for b in range(3):
        rows = [t.transpose(1, 2)[b : b + 1] for t in (q, k, v)]  # (1, seqlen, heads, dim)
        q_b, k_b, v_b = rows[0][:, real_q[b]], rows[1][:, mask[b]], rows[2][:, mask[b]]
        want, _ = attention_reference(q_b, k_b, v_b, 0.25, causal)
        base, _ = attention_reference(q_b, k_b, v_b, 0.25, causal, upcast=False)
        _check_rule(f"row {b}", out[b : b + 1, real_q[b]], base, want, 2)


# --- torch.compile ------------------------------------------------------------------------------


def _compile(model, backend="aot_eager", fullgraph=True):
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=fullgraph)


def _check_logits(got, same, truth, ids, mask) -> None:
    """The logits of every real token by the rule, the truth and its float32 counterpart run row by row."""
    with torch.no_grad():
        want = _logits_row_by_row(truth, ids, mask)
        base = _logits_row_by_row(same, ids, mask)
    _check_rule("logits", got, base, want, 2, keep=mask.bool())


COMPILED_CASES = [
    *(("llama", backend, padding) for backend in BACKENDS for padding in ("none", "left", "right")),
    ("mistral-window4", "sdpa", "left"),
    ("mistral-window4", "triton", "left"),
    ("gemma2-softcap", "reference", "left"),
    ("gemma2-softcap", "triton", "left"),
]


@pytest.mark.parametrize("kind, backend, padding", COMPILED_CASES, ids=["-".join(c) for c in COMPILED_CASES])
def test_compiled_model_runs_in_one_graph_and_matches(kind, backend, padding, device):
    """``torch.compile(model, fullgraph=True)`` (any graph break is an error) gives the logits of
    transformers' own implementation by the rule, padded or not."""
    ours, same, truth = _models(kind, device)
    ids, mask = _inputs(padding, device)
    compiled = _compile(ours)
    with torch.no_grad(), flash_recipe.use_backend(backend):
        got = compiled(ids, attention_mask=mask).logits
    _check_logits(got, same, truth, ids, mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_is_data_not_a_new_graph(backend, device):
    """``torch._dynamo.explain`` of a padded batch: one graph, no break. Then one compilation serves
    batches without padding, with left and with right padding: the mask's values guard nothing."""
    ours, same, truth = _models("llama", device)
    ids, mask = _inputs("left", device)
    with torch.no_grad(), flash_recipe.use_backend(backend):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(ours)(ids, attention_mask=mask)
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = _compile(ours, backend=counter)
        for padding in ("none", "left", "right"):
            ids, mask = _inputs(padding, device)
            _check_logits(compiled(ids, attention_mask=mask).logits, same, truth, ids, mask)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_training_step_gradients_match(backend, device):
    """A compiled training step (left padding, window model; the backward traced by AOTAutograd)
    gives every parameter's gradient by the rule."""
    models = _models("mistral-window4", device)
    ids, mask = _inputs("left", device)
    labels = ids.masked_fill(mask == 0, -100)
    for model in models:
        model.train()
    runs = [_compile(models[0]), models[1], models[2]]
    for i, run in enumerate(runs):
        with flash_recipe.use_backend(backend if i == 0 else None):
            run(ids, attention_mask=mask, labels=labels).loss.backward()
    named = [dict(model.named_parameters()) for model in models]
    for name, param in named[0].items():
        _check_rule(f"grad of {name}", param.grad, named[1][name].grad, named[2][name].grad.double(), 3)


@pytest.mark.slow
def test_inductor_compiles_the_default_backend(device):
    """torch.compile's default compiler (inductor, code generation included; 18 to 20 s on a 2-core
    CPU with an empty inductor cache) on the backend a user gets: SDPA on a CPU (without
    TRITON_INTERPRET), automatic on a GPU."""
    ours, same, truth = _models("llama", device)
    ids, mask = _inputs("left", device)
    compiled = _compile(ours, backend="inductor")
    with torch.no_grad(), flash_recipe.use_backend("sdpa" if device.type == "cpu" else None):
        got = compiled(ids, attention_mask=mask).logits
    _check_logits(got, same, truth, ids, mask)


def test_compiling_emits_no_warning_from_flash_recipe(device, flash_recipe_warnings):
    """No warning or logged warning names flash_recipe's code while a model compiles (Dynamo warns,
    for example, at each call of a functools.lru_cache function it traces into)."""
    ours, _, _ = _models("llama", device)
    ids, mask = _inputs("left", device)
    for backend in BACKENDS:
        with torch.no_grad(), flash_recipe.use_backend(backend):
            _compile(ours)(ids, attention_mask=mask)
    assert not flash_recipe_warnings()


def test_packed_position_ids_fail_loudly_under_compile():
    """Under torch.compile, positions that restart in a row (packed sequences) fail with the way out
    instead of attending across sequences; consecutive positions pass. On the CPU only: on a GPU the
    check is a device-side assertion, which would end the test process's use of the GPU."""
    device = torch.device("cpu")
    ours, same, truth = _models("llama", device)
    ids, _ = _inputs("none", device, batch=1, seqlen=13)
    compiled = _compile(ours)
    with torch.no_grad(), flash_recipe.use_backend("sdpa"):
        with pytest.raises(RuntimeError, match="position_ids restart within a row.*cu_seq_lens_q"):
            compiled(ids, position_ids=torch.tensor([[*range(6), *range(7)]]), use_cache=False)
        got = compiled(ids, position_ids=torch.arange(3, 16)[None], use_cache=False).logits
        want = truth(ids, position_ids=torch.arange(3, 16)[None], use_cache=False).logits
        base = same(ids, position_ids=torch.arange(3, 16)[None], use_cache=False).logits
    _check_rule("logits", got, base, want, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_from_cu_seq_lens(backend, device):
    """Packed rows given as cu_seq_lens_* / max_length_* (what DataCollatorWithFlattening gives with
    return_flash_attn_kwargs=True) stay apart, uncompiled and compiled. Compiled without fullgraph:
    on a CPU, the varlen checks read the offsets on the host (a graph break); on a GPU they do not."""
    ours, same, truth = _models("llama", device)
    ids, _ = _inputs("none", device, batch=1, seqlen=13)
    position_ids = torch.tensor([[*range(6), *range(7)]], device=device)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32, device=device)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    compiled = _compile(ours, fullgraph=False)
    with torch.no_grad():
        want = truth(ids, position_ids=position_ids, use_cache=False).logits
        base = same(ids, position_ids=position_ids, use_cache=False).logits
        with flash_recipe.use_backend(backend):
            for run in (ours, compiled):
                got = run(ids, position_ids=position_ids, use_cache=False, **packed).logits
                _check_rule("logits", got, base, want, 2)
