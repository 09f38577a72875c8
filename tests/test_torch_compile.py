"""torch.compile traces flash_attn_func whole: the kernels are custom ops with fake kernels."""

from __future__ import annotations

import pytest
import torch

import flash_recipe


def _inputs(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 19, 4, 16, generator=gen).to(device).requires_grad_() for _ in range(3)]


def test_custom_ops_pass_opcheck(device):
    """torch.library.opcheck: schema, fake kernel, autograd registration and dispatch agree."""
    from flash_recipe.ops.attention import attn_bwd, attn_fwd

    q, k, v = _inputs(device)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)
    dense = (None, None, 0, 0)
    cu = torch.tensor([0, 7, 7, 38], dtype=torch.int32, device=device)
    packed = [t.detach().reshape(-1, *t.shape[2:])[:38].requires_grad_() for t in (q, k, v)]
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    for tensors, layout, options in (
        ((q, k, v), dense, (0, -1, 0, 0.0, None, 0.0, None)),  # causal
        ((q, k, v), dense, (0, 5, 2, 3.0, slopes, 0.25, seed)),  # window + softcap + ALiBi + dropout
        (packed, (cu, cu, 31, 31), (0, -1, 0, 0.0, None, 0.0, None)),  # varlen, causal
    ):
        args = (*tensors, *layout, 0.25, *options)
        torch.library.opcheck(attn_fwd, args)
        out, lse = attn_fwd(*args)
        dout = torch.randn_like(out)
        detached = [t.detach() for t in tensors]
        torch.library.opcheck(attn_bwd, (dout, *detached, out.detach(), lse, *layout, 0.25, *options))


def test_compiled_model_has_no_graph_break(device):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, q, k, v):
            out = flash_recipe.flash_attn_func(q, k, v, causal=True)
            return self.proj(out).sum()

    model = Block().to(device)
    q, k, v = _inputs(device, seed=1)
    with flash_recipe.use_backend("triton"):
        eager = model(q, k, v)
        eager.backward()
        expected = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        torch._dynamo.reset()
        # fullgraph=True turns any graph break into an error.
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        result = compiled(q, k, v)
        result.backward()
    torch.testing.assert_close(result, eager)
    for t, g in zip((q, k, v), expected):
        torch.testing.assert_close(t.grad, g)


def test_a_new_backend_choice_retraces_the_compiled_function():
    """Under torch.compile the choice of ``use_backend`` is read from a thread-local that Dynamo
    guards on (it cannot read the context variable): choosing another backend retraces, and the
    new graph runs the new backend."""
    q, k, v = (t.detach() for t in _inputs("cpu", seed=2))
    graphs = []

    def record(gm, example_inputs):
        graphs.append("scaled_dot_product_attention" in gm.code)  # the sdpa backend's op
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(flash_recipe.flash_attn_func, backend=record, fullgraph=True)
    with flash_recipe.use_backend("reference"):
        first = compiled(q, k, v)
        compiled(q, k, v)
    with flash_recipe.use_backend("sdpa"):
        second = compiled(q, k, v)
    assert graphs == [False, True]
    torch.testing.assert_close(first, second)


@pytest.mark.parametrize("backend", ["auto", "triton", "sdpa", "reference"])
def test_compiling_emits_no_warning_from_flash_recipe(backend, flash_recipe_warnings):
    """No warning, issued or logged, names flash_recipe's code while a call compiles: the backend
    probes are constants to Dynamo (it warns at each call of a functools.lru_cache function it
    traces into, as the probes once were)."""
    q, k, v = (t.detach() for t in _inputs("cpu", seed=3))
    with flash_recipe.use_backend(backend):
        torch._dynamo.reset()
        torch.compile(flash_recipe.flash_attn_func, backend="aot_eager", fullgraph=True)(q, k, v, causal=True)
    assert not flash_recipe_warnings()
