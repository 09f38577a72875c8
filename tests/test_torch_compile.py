"""torch.compile traces flash_attn_func whole: the kernels are custom ops with fake kernels."""

from __future__ import annotations

import os

import pytest
import torch
from offline import compile_in_subprocess

import flash_recipe


def _inputs(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 19, 4, 16, generator=gen).to(device).requires_grad_() for _ in range(3)]


def test_custom_ops_pass_opcheck(device):
    """torch.library.opcheck: schema, fake kernel, autograd registration and dispatch agree."""
    from flash_recipe.ops.attention import attn_bwd, attn_fwd, flatten
    from flash_recipe.ops.options import ScoreOptions, Varlen

    q, k, v = _inputs(device)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)
    cu = torch.tensor([0, 7, 7, 38], dtype=torch.int32, device=device)
    packed = [t.detach().reshape(-1, *t.shape[2:])[:38].requires_grad_() for t in (q, k, v)]
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    causal = ScoreOptions(
        softmax_scale=0.25, diag_offset=0, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None
    )
    every = causal._replace(window_left=5, window_right=2, softcap=3.0, alibi_slopes=slopes, dropout_p=0.25, seed=seed)
    for tensors, varlen, options in (
        ((q, k, v), None, causal),
        ((q, k, v), None, every),  # window + softcap + ALiBi + dropout
        (packed, Varlen(cu, cu, 31, 31), causal),  # varlen, causal
    ):
        flat = flatten(options, varlen)
        torch.library.opcheck(attn_fwd, (*tensors, *flat, False))
        out, lse = attn_fwd(*tensors, *flat, False)
        dout = torch.randn_like(out)
        detached = [t.detach() for t in tensors]
        torch.library.opcheck(attn_bwd, (dout, *detached, out.detach(), lse, *flat, True, False))


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


def test_a_processes_first_call_may_be_traced_whole():
    """The first flash_recipe call of a fresh process may be one that torch.compile traces with
    ``fullgraph=True``: the Triton backend imports its kernels' modules by import statements, which
    Dynamo runs (it refuses to trace ``importlib.import_module``), so no eager call must come first."""
    rows = compile_in_subprocess("""
        import json, os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        import flash_recipe
        q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
        with flash_recipe.use_backend("triton"):
            traced = torch.compile(flash_recipe.flash_attn_func, backend="aot_eager", fullgraph=True)
            out = traced(q, k, v, causal=True)
        print(json.dumps({"shape": list(out.shape), "finite": bool(out.isfinite().all())}))
    """)
    assert rows == [{"shape": [1, 16, 2, 16], "finite": True}]


def _missing_in_subprocess(kernels: str) -> dict:
    """``inductor_source.missing_names`` of ``kernels`` (a Python expression there), compiled mode."""
    here = os.path.dirname(os.path.abspath(__file__))
    rows = compile_in_subprocess(f"""
        import json, sys
        sys.path.insert(0, {here!r})
        import inductor_source
        print(json.dumps(inductor_source.missing_names({kernels})))
    """)
    return rows[0]


def test_every_kernel_compiles_from_inductors_regenerated_source():
    """Every kernel of the package resolves every name it uses in the source Inductor regenerates
    for it (``inductor_source``). ``rotary_append_kernel`` once reached ``load_tile`` as
    ``tiles.load_tile``: a NameError on a GPU under ``torch.compile`` (the campaign's capture step)."""
    missing = _missing_in_subprocess("__import__('flash_recipe.ops.offline').ops.offline.jit_kernels()")
    if missing.get("skipped"):
        pytest.skip(missing["skipped"])
    assert {"attn_fwd_kernel", "rotary_append_kernel", "attn_bwd_dkdv_kernel"} <= set(missing)
    assert not any(missing.values()), missing


def test_the_regenerated_source_check_finds_a_helper_reached_through_its_module():
    """The check can fail: a kernel that calls a helper as ``tiles.<name>`` is flagged."""
    missing = _missing_in_subprocess("{'planted': inductor_source.through_module_kernel}")
    if missing.get("skipped"):
        pytest.skip(missing["skipped"])
    assert missing == {"planted": ["through_module_kernel: tiles"]}


def test_each_option_is_declared_once_across_the_op_boundary():
    """Both ops' schemas and the flattening come from ``OPTION_PARAMS`` alone: the schemas list its
    names and types in order, it names exactly the fields of ``Varlen`` and ``ScoreOptions`` (a new
    option cannot cross without being declared there), the op functions take the options only as
    ``*rest``, and ``unflatten`` undoes ``flatten``."""
    import inspect

    from flash_recipe.ops import attention
    from flash_recipe.ops.options import ScoreOptions, Varlen

    declared = [(name, kind) for name, kind in attention.OPTION_PARAMS]
    assert [name for name, _ in declared] == [*Varlen._fields, *ScoreOptions._fields]
    for op, leading, flags in (
        (torch.ops.flash_recipe.attn_fwd.default, 3, ["deterministic"]),
        (torch.ops.flash_recipe.attn_bwd.default, 6, ["own_lse", "deterministic"]),
    ):
        arguments = op._schema.arguments
        options = [(a.name, str(a.type)) for a in arguments[leading : leading + len(declared)]]
        schema_kind = {"Tensor?": "Optional[Tensor]", "SymInt": "int", "float": "float"}  # as str() prints them
        assert options == [(name, schema_kind[kind]) for name, kind in declared]
        assert [a.name for a in arguments[leading + len(declared) :]] == flags
    for fn in (attention._attn_fwd, attention._attn_bwd):
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
        assert kinds[-1] == inspect.Parameter.VAR_POSITIONAL and inspect.Parameter.VAR_POSITIONAL not in kinds[:-1]
    slopes, seed, sinks, cu = torch.rand(4), torch.zeros(1, dtype=torch.int64), torch.rand(4), torch.zeros(3)
    options = ScoreOptions(
        softmax_scale=0.3, diag_offset=2, window_left=5, window_right=0, softcap=7.0, alibi_slopes=slopes,
        dropout_p=0.1, seed=seed, sinks=sinks,
    )  # fmt: skip
    for varlen in (None, Varlen(cu, cu, 9, 11)):
        flat = attention.flatten(options, varlen)
        assert len(flat) == len(declared)
        assert attention.unflatten(flat) == (options, varlen)
