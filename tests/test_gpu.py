"""The kernels at realistic sizes on a GPU, fp16 and bf16 (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import flash_recipe
from flash_recipe.tools.verify import Case, check_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]

CASES = [
    Case(2, 113, 203, 8, 2, 64, True),
    Case(2, 128, 217, 16, 16, 128, False),
    Case(2, 108, 256, 8, 1, 96, True),
    Case(1, 1023, 1024, 16, 4, 128, True),
    Case(4, 1, 147, 8, 8, 256, False),
    Case(2, 2048, 2048, 16, 16, 64, True),
    Case(1, 4096, 4096, 32, 8, 128, True),
    Case(1, 8192, 8192, 16, 16, 128, False),
    Case(1, 8192, 8192, 8, 2, 256, True),
    Case(2, 1000, 3000, 12, 4, 111, True),
    Case(2, 3000, 1000, 12, 4, 160, True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_accuracy_at_scale(case, dtype, nan_outputs):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    row = check_case(case, dtype, torch.device("cuda"), "triton", seed=0)
    assert row["passed"], {n: (row["errors"][n], row["bounds"][n]) for n in row["errors"]}


def test_automatic_choice_on_gpu_is_a_compiled_backend():
    if torch.version.hip is None and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("pre-Ampere GPUs fall back to torch SDPA by design")
    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.float16)
    reasons = flash_recipe.explain(q, q, q)
    chosen = next(name for name, why in reasons.items() if why is None)
    assert chosen in ("flash_attn", "triton"), reasons
