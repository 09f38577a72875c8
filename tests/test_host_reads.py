"""No call reads the values of its metadata tensors on the host: what CUDA-graph capture needs.

On a GPU, ``cu_seqlens``, ``cache_seqlens``, ``cache_batch_idx``, ``cache_leftpad``,
``block_table`` and the dropout seed live in device memory; reading one on the host (``.item()``,
``.tolist()``, ``bool(t)``, ``int(t)``, ``.cpu()``, ``.numpy()``, ``if t:``, ``range(t)``, printing
it) synchronises the device on every call and cannot be captured in a CUDA graph. The library
decides whether it reads metadata values in one function, ``flash_recipe.validate.on_host``: True
for CPU tensors, whose values the checks read to give clear errors.

This machine has no GPU: every tensor is on the CPU. The tests make ``validate.on_host`` answer
False, so the metadata stands for device memory: that one decision is what differs on a GPU. Then
they run the public calls on the Triton kernels (through the interpreter) under ``HostReadGuard``,
which raises on any host read of the metadata, of tensors computed from it, and of integer tensors
the library makes on the device (the dropout seed), and compare the results bit for bit with the
same calls run without the guard and with ``on_host`` as it is. Each call runs twice: the first
call of a signature runs the checks and plans the launches, a repeated one takes the memos
(``flash_recipe.memo_keys``); both must be clean.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional

import pytest
import torch
from torch.overrides import TorchFunctionMode

import flash_recipe
from flash_recipe import memo_keys, validate
from flash_recipe.ops import attention as ops_attention

# Tensor methods and torch functions that bring a tensor's values to the host (or need them there
# to size their result). ``__len__`` reads only the shape and ``__iter__`` is not a torch function
# (gh-54457): iterating gives 0-dim tensors computed from the tensor, which the guard then watches.
HOST_READS = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__index__",
        "__float__",
        "__complex__",
        "cpu",
        "numpy",
        "__array__",
        "__repr__",
        "__format__",
        "equal",
        "allclose",
        "is_nonzero",
        "nonzero",
        "argwhere",
        "unique",
        "unique_consecutive",
        "bincount",
    }
)
# Factories whose integer result, placed on a device (``device=q.device``), is device memory too.
FACTORIES = frozenset({"arange", "empty", "full", "ones", "randint", "tensor", "zeros"})


class HostRead(Exception):
    """A host read of a tensor that stands for device memory."""


def _leaves(x) -> list:
    """The items of nested tuples, lists and dicts (a call's arguments, its result)."""
    if isinstance(x, (tuple, list)):
        return [leaf for item in x for leaf in _leaves(item)]
    if isinstance(x, dict):
        return _leaves(list(x.values()))
    return [x]


class HostReadGuard(TorchFunctionMode):
    """Raises ``HostRead`` (and records it in ``reads``) when a watched tensor's values are read on
    the host: the tensors given to ``watch``, the integer and bool tensors computed from them, and
    the integer tensors that factories make with a ``device=`` argument (``device=q.device``).

    A torch-function mode is off the stack while it handles a call, so it cannot see into the body
    of a custom op or of ``Tensor.backward``: the launchers run there re-enter it (``see_inside``),
    and a launch it saw nothing of is recorded as a read it cannot rule out."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.watched: list[str] = []  # the names given to ``watch``
        self._tensors: dict[int, tuple] = {}  # id -> (weakref to the tensor, root name, the op that made it)
        self._handling = 0  # > 0 while handling a call: the mode is then off the stack
        self._calls = 0  # calls seen

    def watch(self, name: str, t: torch.Tensor) -> None:
        self._tensors[id(t)] = (weakref.ref(t), name, None)
        self.watched.append(name)

    def _entry(self, t) -> Optional[tuple]:
        entry = self._tensors.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry if entry is not None and entry[0]() is t else None

    def name_of(self, t) -> Optional[str]:
        entry = self._entry(t)
        if entry is None:
            return None
        return entry[1] if entry[2] is None else f"{entry[1]} (through {entry[2]})"

    def see_inside(self, fn: Callable) -> Callable:
        """``fn``, run under the guard also where the mode is off the stack (a custom op's body)."""

        def guarded(*args, **kwargs):
            if self._handling:
                with self:
                    return fn(*args, **kwargs)
            before = self._calls
            result = fn(*args, **kwargs)
            if self._calls == before:
                self.reads.append(f"the guard saw nothing of {fn.__name__}: it cannot rule out a host read there")
            return result

        return guarded

    def _read(self, name: str, args, kwargs) -> Optional[str]:
        """What a call reads on the host, or None."""
        if name in HOST_READS:
            for t in _leaves((args, kwargs)):
                watched = self.name_of(t)
                if watched is not None:
                    return f"{name}() read {watched} on the host"
        elif name == "to" and any(
            isinstance(a, str) and a.startswith("cpu") for a in (*args[1:], kwargs.get("device"))
        ):
            # Only the host spelled out: on a GPU, ``t.to(q.device)`` stays on the device.
            watched = self.name_of(args[0])
            if watched is not None:
                return f"to('cpu') copied {watched} to the host"
        elif name in ("__getitem__", "__setitem__") and len(args) > 1:
            for index in _leaves(args[1]):
                watched = self.name_of(index)
                if watched is not None and index.dtype == torch.bool:
                    return f"{name} with the bool mask {watched} (its True count sizes the result on the host)"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        self._calls += 1
        found = self._read(name, args, kwargs)
        if found is not None:
            self.reads.append(found)
            raise HostRead(f"{found}: on a GPU this synchronises the device and breaks CUDA-graph capture")
        self._handling += 1
        try:
            result = func(*args, **kwargs)
        finally:
            self._handling -= 1
        source = next((e for e in map(self._entry, _leaves((args, kwargs))) if e is not None), None)
        if source is not None:
            root = source[1]
        elif name in FACTORIES and isinstance(kwargs.get("device"), torch.device):
            root = f"the tensor torch.{name} made on the device"
        else:
            return result
        for out in _leaves(result):
            integral = isinstance(out, torch.Tensor) and not (out.is_floating_point() or out.is_complex())
            if integral and self._entry(out) is None:
                self._tensors[id(out)] = (weakref.ref(out), root, name if source is not None else None)
        return result


@pytest.fixture
def fresh_memos():
    """Every memo of ``flash_recipe`` empty before and after: the first call of a signature takes
    the full path, and no verdict reached with ``on_host`` patched outlives the test."""

    memo_keys.forget()
    yield memo_keys.forget
    memo_keys.forget()


def _rand(*shape, dtype=torch.float16, seed=0, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_() if grad else t


def _i32(*rows):
    return torch.tensor(rows, dtype=torch.int32)


@dataclasses.dataclass(frozen=True)
class Case:
    """``make()`` gives fresh CPU inputs (the same values each time); ``call(inputs)`` runs the public call
    and returns the tensors to compare (outputs, gradients, the cache it wrote); ``metadata`` names
    the inputs that live on the device."""

    name: str
    make: Callable[[], dict]
    call: Callable[[dict], tuple]
    metadata: tuple


def _rotary(rotary_dim=8, positions=64):
    angles = torch.arange(positions)[:, None] * (1e-2 * torch.arange(1, rotary_dim // 2 + 1))[None, :]
    return angles.cos().half(), angles.sin().half()


def _kvcache_dense():
    cos, sin = _rotary()
    return dict(
        q=_rand(2, 2, 4, 16, seed=1),
        k_cache=_rand(3, 40, 2, 16, seed=2),
        v_cache=_rand(3, 40, 2, 16, seed=3),
        k=_rand(2, 2, 2, 16, seed=4),
        v=_rand(2, 2, 2, 16, seed=5),
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=_i32(5, 30),
        cache_batch_idx=_i32(2, 0),
        cache_leftpad=_i32(1, 0),
    )


def _kvcache_paged():
    cos, sin = _rotary()
    return dict(
        q=_rand(2, 2, 4, 16, seed=1),
        k_cache=_rand(5, 16, 2, 16, seed=2),
        v_cache=_rand(5, 16, 2, 16, seed=3),
        k=_rand(2, 2, 2, 16, seed=4),
        v=_rand(2, 2, 2, 16, seed=5),
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=_i32(5, 20),
        cache_leftpad=_i32(2, 0),
        block_table=_i32([3, 1], [0, 4]),
    )


def _kvcache_call(**options):
    def call(inputs):
        out, lse = flash_recipe.flash_attn_with_kvcache(**inputs, return_softmax_lse=True, **options)
        return out, lse, inputs["k_cache"], inputs["v_cache"]

    return call


def _varlen(grad=False):
    return dict(
        q=_rand(12, 4, 16, seed=1, grad=grad),
        k=_rand(20, 2, 16, seed=2, grad=grad),
        v=_rand(20, 2, 16, seed=3, grad=grad),
        cu_seqlens_q=_i32(0, 5, 12),
        cu_seqlens_k=_i32(0, 8, 20),
    )


def _varlen_call(inputs):
    out, lse, _ = flash_recipe.flash_attn_varlen_func(
        **inputs, max_seqlen_q=7, max_seqlen_k=12, causal=True, return_attn_probs=True
    )
    return out, lse


def _varlen_backward(inputs):
    out = flash_recipe.flash_attn_varlen_func(**inputs, max_seqlen_q=7, max_seqlen_k=12, causal=True)
    out.float().sum().backward()
    return out, inputs["q"].grad, inputs["k"].grad, inputs["v"].grad


def _paged_varlen():
    return dict(
        q=_rand(8, 4, 16, seed=1),
        k=_rand(4, 16, 2, 16, seed=2),
        v=_rand(4, 16, 2, 16, seed=3),
        cu_seqlens_q=_i32(0, 3, 8),
        cu_seqlens_k=_i32(0, 20, 30),
        block_table=_i32([2, 0], [3, 1]),
    )


def _paged_varlen_call(inputs):
    out, lse, _ = flash_recipe.flash_attn_varlen_func(
        **inputs, max_seqlen_q=5, max_seqlen_k=20, causal=True, return_attn_probs=True
    )
    return out, lse


def _dense(grad=False):
    return dict(
        q=_rand(2, 24, 4, 16, seed=1, grad=grad),
        k=_rand(2, 40, 2, 16, seed=2, grad=grad),
        v=_rand(2, 40, 2, 16, seed=3, grad=grad),
    )


def _dense_call(**options):
    def call(inputs):
        torch.manual_seed(0)  # the dropout seed: the same draw in every run
        out = flash_recipe.flash_attn_func(**inputs, causal=True, **options)
        if not inputs["q"].requires_grad:
            return (out,)
        out.float().sum().backward()
        return out, inputs["q"].grad, inputs["k"].grad, inputs["v"].grad

    return call


def _kvcache_made_on_the_device():
    """``cache_seqlens`` an int and no ``cache_batch_idx``: the library makes both tensors on q's device."""
    inputs = _kvcache_dense()
    del inputs["cache_batch_idx"], inputs["cache_leftpad"], inputs["rotary_cos"], inputs["rotary_sin"]
    return dict(inputs, k_cache=inputs["k_cache"][:2], v_cache=inputs["v_cache"][:2], cache_seqlens=30)


CU = ("cu_seqlens_q", "cu_seqlens_k")
CASES = [
    Case(
        "kvcache-B2-q2-new2-H4-Hk2-D16-batchidx-leftpad-rotary",
        _kvcache_dense,
        _kvcache_call(causal=True),
        ("cache_seqlens", "cache_batch_idx", "cache_leftpad"),
    ),
    Case(
        "kvcache-paged16-B2-q2-new2-H4-Hk2-D16-leftpad-rotary-split2",
        _kvcache_paged,
        _kvcache_call(causal=True, num_splits=2),
        ("cache_seqlens", "cache_leftpad", "block_table"),
    ),
    Case(
        "kvcache-B2-q2-new2-H4-Hk2-D16-seqlens-int-window",
        _kvcache_made_on_the_device,
        _kvcache_call(window_size=(6, 0)),
        (),
    ),
    Case("varlen-B2-Sq5.7-Sk8.12-H4-Hk2-D16-causal", _varlen, _varlen_call, CU),
    Case("varlen-B2-Sq5.7-Sk8.12-H4-Hk2-D16-causal-backward", lambda: _varlen(grad=True), _varlen_backward, CU),
    Case("varlen-paged16-B2-Sq3.5-Sk20.10-H4-Hk2-D16-causal", _paged_varlen, _paged_varlen_call, (*CU, "block_table")),
    Case("dense-B2-Sq24-Sk40-H4-Hk2-D16-causal", _dense, _dense_call(), ()),
    Case("dense-B2-Sq24-Sk40-H4-Hk2-D16-causal-dropout", _dense, _dense_call(dropout_p=0.25), ()),
    Case("dense-B2-Sq24-Sk40-H4-Hk2-D16-causal-backward", lambda: _dense(grad=True), _dense_call(), ()),
    Case(
        "dense-B2-Sq24-Sk40-H4-Hk2-D16-causal-dropout-backward",
        lambda: _dense(grad=True),
        _dense_call(dropout_p=0.25),
        (),
    ),
]


def _on(device: torch.device, inputs: dict) -> dict:
    """``inputs`` on ``device``: on a GPU the metadata is device memory, as it is for users."""
    return {
        name: t.detach().to(device).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
        for name, t in inputs.items()
    }


def _guarded(monkeypatch, guard: HostReadGuard) -> None:
    """The metadata stands for device memory (``on_host`` False), the guard sees into the launchers
    that custom ops and the backward run, and names each dropout seed it draws."""
    monkeypatch.setattr(validate, "on_host", lambda t: False)
    for name in ("attention_forward", "attention_backward"):
        monkeypatch.setattr(ops_attention, name, guard.see_inside(getattr(ops_attention, name)))
    new_seed = ops_attention.new_seed

    def watched_seed(device):
        seed = new_seed(device)
        guard.watch("the dropout seed (ops.attention.new_seed)", seed)
        return seed

    monkeypatch.setattr(ops_attention, "new_seed", watched_seed)


def _checks_counted(monkeypatch) -> list:
    """A list that grows by one each time the public layer runs its full checks (``check_qkv``
    starts them for every call here); a call that takes the memo adds nothing."""
    runs: list = []
    check_qkv = validate.check_qkv

    def counted(*args, **kwargs):
        runs.append(1)
        return check_qkv(*args, **kwargs)

    monkeypatch.setattr(validate, "check_qkv", counted)
    return runs


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_no_host_read_of_device_metadata(case, device, monkeypatch, fresh_memos):
    """The first and the repeated call of a signature read no metadata on the host, and give what
    the same call gives with ``on_host`` as it is and no guard, bit for bit."""
    with flash_recipe.use_backend("triton"):
        want = case.call(_on(device, case.make()))
        fresh_memos()
        guard = HostReadGuard()
        _guarded(monkeypatch, guard)
        checks = _checks_counted(monkeypatch)
        for attempt in ("first", "repeated"):
            inputs = _on(device, case.make())
            before = len(checks)
            with guard:
                for name in case.metadata:
                    guard.watch(name, inputs[name])
                got = case.call(inputs)
            assert guard.reads == [], f"{attempt} call: {guard.reads}"
            assert (len(checks) > before) == (attempt == "first"), f"the {attempt} call took the other path"
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, attempt=attempt: f"{attempt} call: {m}")
    if "dropout" in case.name:
        assert "the dropout seed (ops.attention.new_seed)" in guard.watched


def test_the_dropout_seed_is_an_int64_tensor_on_q_device(device):
    """The dropout seed lives where q does (on a GPU, device memory, like the metadata)."""
    seed = ops_attention.new_seed(device)
    assert (seed.dtype, tuple(seed.shape), seed.device.type) == (torch.int64, (1,), device.type)


READS = [
    ("tolist", lambda t: t.tolist()),
    ("item", lambda t: t[0].item()),
    ("int", lambda t: int(t[0])),
    ("bool", lambda t: bool(t[0] > 0)),
    ("range", lambda t: range(t[0])),
    ("float", lambda t: float(t[1])),
    ("cpu", lambda t: t.cpu()),
    ("numpy", lambda t: t.numpy()),
    ("to-cpu", lambda t: t.to("cpu")),
    ("print", lambda t: f"{t}"),
    ("iterate-and-compare", lambda t: [n for n in t if n > 4]),
    ("mask", lambda t: t[t > 4]),
]


@pytest.mark.parametrize("read", [r[1] for r in READS], ids=[r[0] for r in READS])
def test_the_guard_catches_a_host_read_added_on_the_path(read, device, monkeypatch, fresh_memos):
    """A read of ``cache_seqlens``, or of a value computed from it, added to a library function on
    the path (here the triton backend's cache entry point) fails the call."""
    from flash_recipe.dispatch.triton_backend import TritonBackend

    run_cache = TritonBackend.run_cache

    def reading(self, call):
        read(call.seqlens)
        return run_cache(self, call)

    monkeypatch.setattr(TritonBackend, "run_cache", reading)
    guard = HostReadGuard()
    _guarded(monkeypatch, guard)
    inputs = _on(device, _kvcache_paged())
    with flash_recipe.use_backend("triton"), pytest.raises(HostRead, match="cache_seqlens"), guard:
        for name in ("cache_seqlens", "cache_leftpad", "block_table"):
            guard.watch(name, inputs[name])
        _kvcache_call(causal=True)(inputs)
    assert len(guard.reads) == 1 and "cache_seqlens" in guard.reads[0]


def test_the_guard_catches_a_read_inside_the_backward(device, monkeypatch, fresh_memos):
    """The backward runs with the mode off the stack; the guard re-enters at its launcher, so a read
    of ``cu_seqlens`` there fails too."""
    from flash_recipe.ops import backward_launch

    launch = backward_launch.attention_backward

    def reading(dout, q, k, v, out, lse, options, varlen, *args, **kwargs):
        varlen.cu_seqlens_k.tolist()
        return launch(dout, q, k, v, out, lse, options, varlen, *args, **kwargs)

    monkeypatch.setattr(ops_attention, "attention_backward", reading)
    guard = HostReadGuard()
    _guarded(monkeypatch, guard)
    inputs = _on(device, _varlen(grad=True))
    with flash_recipe.use_backend("triton"), pytest.raises(HostRead, match=r"tolist\(\) read cu_seqlens_k"), guard:
        for name in CU:
            guard.watch(name, inputs[name])
        _varlen_backward(inputs)


def test_with_on_host_the_checks_read_cpu_metadata(monkeypatch, fresh_memos):
    """Without the patch, CPU metadata is read by the checks on purpose: the guard sees it (so a
    clean run above is the patch's doing, not a guard that sees nothing)."""
    guard = HostReadGuard()
    inputs = _kvcache_dense()
    with flash_recipe.use_backend("triton"), pytest.raises(HostRead, match=r"tolist\(\) read cache_seqlens"), guard:
        guard.watch("cache_seqlens", inputs["cache_seqlens"])
        _kvcache_call(causal=True)(inputs)


def test_the_guard_watches_what_the_library_makes_on_the_device(device, monkeypatch, fresh_memos):
    """With ``cache_seqlens`` an int, the library makes the lengths tensor on q's device itself; a
    host read of it fails like one of a tensor the caller passed."""
    from flash_recipe.dispatch.triton_backend import TritonBackend

    run_cache = TritonBackend.run_cache

    def reading(self, call):
        call.seqlens.tolist()
        return run_cache(self, call)

    monkeypatch.setattr(TritonBackend, "run_cache", reading)
    guard = HostReadGuard()
    _guarded(monkeypatch, guard)
    with flash_recipe.use_backend("triton"), pytest.raises(HostRead, match="torch.full made on the device"), guard:
        _kvcache_call(window_size=(6, 0))(_on(device, _kvcache_made_on_the_device()))
