"""FlashAttention-3's callers on the FA3 stand-in, each in a fresh process (``python fa3_clients.py
NAME`` prints one JSON line): the callers decide once per process whether FA3 is there
(transformers' checks are ``lru_cache``d, diffusers' run at import), so the stand-in is installed
before they are imported, as a user would.

- ``transformers``: a tiny random Llama with ``attn_implementation="flash_attention_3"`` against
  the same model on ``sdpa``: the logits of a left-padded batch (transformers unpads it and calls
  the varlen function) and of an unpadded one (the dense function), by the accuracy rule against
  float64 ``sdpa``; and greedy ``generate`` with the KV cache, token for token. transformers also
  requires CUDA for FA3: its cached ``is_torch_cuda_available()`` is answered True once, before its
  first FA3 check, and torch's own answer is restored at once. That is the one stub; the model
  and every tensor stay on the CPU.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from unittest import mock

import torch

import flash_recipe

VOCAB, PAD = 97, 0


def _cuda_answered_once() -> None:
    """transformers' ``is_torch_cuda_available()`` (``lru_cache``d) answers True in this process;
    ``torch.cuda.is_available`` is patched only while it is asked."""
    from transformers.utils import import_utils

    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        assert import_utils.is_torch_cuda_available()
        assert import_utils.is_flash_attn_3_available()


def _counted(function, calls: dict, key: str):
    """``function`` counting its calls in ``calls[key]``, with its signature (transformers reads it)."""

    @functools.wraps(function)
    def counting(*args, **kwargs):
        calls[key] += 1
        return function(*args, **kwargs)

    return counting


def transformers_client() -> dict:
    if not flash_recipe.install_as_flash_attn_3():
        raise RuntimeError("install_as_flash_attn_3() left an upstream FA3 in place")
    import transformers

    from flash_recipe.testing import FACTORS, assert_accurate

    _cuda_answered_once()
    from transformers import modeling_flash_attention_utils as fa_utils

    config = transformers.LlamaConfig(
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
    calls: dict = {"dense": 0, "varlen": 0}
    import flash_attn_interface  # counted before transformers takes its functions

    for name, key in (("flash_attn_func", "dense"), ("flash_attn_varlen_func", "varlen")):
        setattr(flash_attn_interface, name, _counted(getattr(flash_attn_interface, name), calls, key))

    torch.manual_seed(0)
    models = {}
    weights = None
    for impl, dtype in (("flash_attention_3", torch.float32), ("sdpa", torch.float32), ("sdpa", torch.float64)):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        weights = weights if weights is not None else copy.deepcopy(model.state_dict())
        model.load_state_dict(weights)
        models[impl, dtype] = model.to(dtype).eval()
    assert models["flash_attention_3", torch.float32].config._attn_implementation == "flash_attention_3"

    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    errors = {}
    for case, attention_mask in (("padded", mask), ("unpadded", None)):
        with torch.no_grad():
            got, same, truth = (
                models[key](ids, attention_mask=attention_mask).logits
                for key in (("flash_attention_3", torch.float32), ("sdpa", torch.float32), ("sdpa", torch.float64))
            )
        keep = mask.bool() if attention_mask is not None else torch.ones_like(mask, dtype=torch.bool)
        assert_accurate(f"logits ({case})", got[keep], truth[keep], same[keep], FACTORS["out"])
        errors[case] = float((got[keep].double() - truth[keep]).abs().max())
    generated = {}
    for key in (("flash_attention_3", torch.float32), ("sdpa", torch.float64)):
        generated[key[0]] = models[key].generate(ids[1:], max_new_tokens=6, do_sample=False, min_new_tokens=6).tolist()
    assert generated["flash_attention_3"] == generated["sdpa"], generated
    return {
        "calls": calls,
        "errors": errors,
        "tokens": len(generated["sdpa"][0]),
        "loaded": fa_utils._loaded_implementation,
    }


CLIENTS = {"transformers": transformers_client}

if __name__ == "__main__":
    print(json.dumps(CLIENTS[sys.argv[1]]()))
