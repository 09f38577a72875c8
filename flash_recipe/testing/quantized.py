"""The accuracy of 8-bit attention as a method: SageAttention's own metrics against unquantized
attention in fp32, the bounds they must meet, and the realistic inputs they are measured on.

Two checks cover 8-bit attention (docs/int8-attention.md gives the reasoning):

(a) **the kernel is right**: its output against an fp64 reference that applies the same
    quantization (``reference_int8.attention_from_quantized``), by the accuracy rule
    (``testing.accuracy``), unchanged;
(b) **the method is as accurate as claimed**: against plain fp32 attention of the unquantized
    inputs, three metrics over the whole output (``method_metrics``)::

        cosine  = <got, truth> / (|got| |truth|)
        rel_l1  = sum |got - truth| / sum |truth|
        rmse    = sqrt(mean((got - truth)^2))

    each within ``METRIC_BOUNDS``. The bounds come from measurements on ``realistic_inputs`` (the
    table in docs/int8-attention.md, printed by ``python -m flash_recipe.testing.quantized``):
    about 2x the worst rel_l1 and rmse measured with smoothing, 1 - cosine likewise, and each
    crossed by the same inputs without K smoothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..reference import attention_reference

# (b)'s bounds (``method_metrics``' keys): the smallest cosine and the largest rel_l1 and rmse.
METRIC_BOUNDS = {"cosine": 0.9996, "rel_l1": 0.04, "rmse": 0.006}


def method_metrics(got: Any, truth: Any) -> dict:
    """SageAttention's metrics of ``got`` against ``truth`` (same shape), in fp64, over every element
    that is finite in ``truth`` (rows that see no key have no value to compare)."""
    got, truth = got.double().flatten(), truth.double().flatten()
    keep = torch.isfinite(truth)
    got, truth = got[keep], truth[keep]
    diff = got - truth
    norms = got.norm() * truth.norm()
    return {
        "cosine": (got @ truth / norms).item() if norms > 0 else 1.0,
        "rel_l1": (diff.abs().sum() / truth.abs().sum().clamp(min=1e-30)).item(),
        "rmse": diff.pow(2).mean().sqrt().item() if diff.numel() else 0.0,
    }


def metric_failures(metrics: dict, bounds: dict = METRIC_BOUNDS) -> list:
    """The metrics outside ``bounds``, as readable strings (empty: all within)."""
    failures = []
    if not metrics["cosine"] >= bounds["cosine"]:
        failures.append(f"cosine {metrics['cosine']:.6f} < {bounds['cosine']}")
    for key in ("rel_l1", "rmse"):
        if not metrics[key] <= bounds[key]:
            failures.append(f"{key} {metrics[key]:.4g} > {bounds[key]}")
    return failures


def assert_method_accurate(name: str, got: Any, truth: Any) -> dict:
    """Raise AssertionError naming ``name`` and the metrics unless ``got`` meets ``METRIC_BOUNDS``
    against ``truth`` (unquantized attention in fp32 or fp64); return the metrics."""
    metrics = method_metrics(got, truth)
    failures = metric_failures(metrics)
    if failures:
        raise AssertionError(f"{name}: 8-bit attention outside the method's bounds: {'; '.join(failures)}")
    return metrics


def realistic_inputs(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_k: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    offset: float = 8.0,
    outliers: int = 2,
    outlier_scale: float = 12.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(B, S, H, D)`` shaped like the activations SageAttention's paper describes: K carries
    a large offset common to all tokens (a per-channel bias of standard deviation ``offset``), and
    in ``outliers`` channels that bias is ``outlier_scale`` times larger (the channel outliers of
    K, which the paper finds to be shared by the tokens); Q and V are Gaussian, Q scaled so the
    softmax is peaked rather than flat (logits spread by about 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, generator=gen) * 1.5
    bias = torch.randn(batch, 1, nheads_k, head_dim, generator=gen) * offset
    if outliers:
        channels = torch.randperm(head_dim, generator=gen)[:outliers]
        bias[..., channels] *= outlier_scale
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=gen) + bias
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def unquantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Plain attention of the inputs in fp32 (no quantization): (b)'s truth, ``(B, Sq, H, D)``."""
    out, _ = attention_reference(q.float(), k.float(), v.float(), softmax_scale=scale, causal=causal)
    return out


def _table() -> None:  # pragma: no cover - prints the measurements behind METRIC_BOUNDS
    from .. import reference_int8  # the table's only user: importing testing loads no method

    rows = [("shape", "causal", "smooth", "cosine", "rel_l1", "rmse")]
    for batch, sq, sk, h, hk, d in ((1, 1024, 1024, 2, 2, 64), (1, 1024, 1024, 2, 1, 128), (1, 256, 4096, 1, 1, 128)):
        for causal in (False, True):
            q, k, v = realistic_inputs(batch, sq, sk, h, hk, d, torch.float16)
            truth = unquantized(q, k, v, causal, d**-0.5)
            for smooth in (True, False):
                out, _ = reference_int8.sage_attention(q, k, v, d**-0.5, causal, smooth, False)
                m = method_metrics(out, truth)
                rows.append(
                    (
                        f"B{batch} Sq{sq} Sk{sk} H{h}/{hk} D{d}",
                        str(causal),
                        str(smooth),
                        f"{m['cosine']:.6f}",
                        f"{m['rel_l1']:.4f}",
                        f"{m['rmse']:.4f}",
                    )
                )
    for row in rows:
        print(" | ".join(row))
    print("bounds:", METRIC_BOUNDS, "log10(1 - cosine) bound:", round(math.log10(1 - METRIC_BOUNDS["cosine"]), 2))


if __name__ == "__main__":  # pragma: no cover
    _table()
