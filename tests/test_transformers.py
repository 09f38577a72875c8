"""The transformers integration: tiny random models give the logits, gradients and generated
tokens of transformers' own attention implementations, by the accuracy rule.

The truth is the same model with transformers' own implementation (``sdpa``, or ``eager`` where
the model has no sdpa path) in float64; the allowed error is 2x (forward) or 3x (gradients) that
implementation's own float32 error, plus 1e-5. Each test runs on flash_recipe's fallback (SDPA, or
its reference where SDPA cannot softcap) and on its Triton kernels (through the interpreter on a
CPU machine).
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

NAME = fr_transformers.ATTN_IMPLEMENTATION
VOCAB, SEQLEN, PAD = 97, 11, 0
BACKENDS = ["sdpa", "triton"]


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
    """max|got - truth| <= factor * max|same - truth| + 1e-5, over the entries ``keep`` selects."""
    got, same = got.double(), same.double()
    if keep is not None:
        got, same, truth = got[keep], same[keep], truth[keep]
    err = (got - truth).abs().max().item()
    base = (same - truth).abs().max().item()
    assert err <= factor * base + 1e-5, f"{name}: max error {err:.3g} > {factor} x {base:.3g} + 1e-5"


# torch SDPA has no softcap: flash_recipe's CPU fallback for Gemma 2 is its reference backend.
MODEL_BACKENDS = [
    *((kind, backend) for kind in ("llama", "mistral-window4") for backend in BACKENDS),
    ("gemma2-softcap", "reference"),
    ("gemma2-softcap", "triton"),
]


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind, backend", MODEL_BACKENDS, ids=[f"{k}-{b}" for k, b in MODEL_BACKENDS])
def test_logits_match_by_accuracy_rule(kind, backend, padding, device):
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind, padding", [("llama", "left"), ("llama", "none"), ("mistral-window4", "left")])
def test_generate_with_kv_cache_matches(kind, padding, backend, device):
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_gradients_match(backend, device):
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
