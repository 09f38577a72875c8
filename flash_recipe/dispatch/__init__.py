"""Backend registry and selection.

One module per backend (``triton_backend``, ``flash_attn_backend``, ``sdpa_backend``,
``reference_backend``), each implementing the interface in ``base``. Automatic selection walks
``BACKENDS`` in priority order and takes the first that can run the call. An explicit choice
(``use_backend("triton")`` or ``FLASH_RECIPE_BACKEND=triton``) that cannot run raises
``BackendUnavailableError`` listing the reason. The same reasons feed ``explain()`` and
``flash-recipe doctor``.

Nothing here imports Triton or flash-attn, compiles or probes anything until a call needs it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Callable, Optional

import torch

from .. import alias
from ..environ import getenv
from ..memo_keys import Memo, signature
from ..ops import targets
from .base import Backend, BackendUnavailableError
from .call import CALL_FIELDS, AttentionCall, CacheCall, PagedCall
from .capabilities import TURING_ISSUES, pre_ampere_reason
from .flash_attn_backend import FlashAttnBackend
from .reference_backend import ReferenceBackend
from .sdpa_backend import SdpaBackend
from .triton_backend import TritonBackend

__all__ = [
    "AttentionCall",
    "Backend",
    "BackendUnavailableError",
    "BACKENDS",
    "CacheCall",
    "FlashAttnBackend",
    "PagedCall",
    "ReferenceBackend",
    "SdpaBackend",
    "TritonBackend",
    "TURING_ISSUES",
    "available_backends",
    "backend_names",
    "explain_call",
    "forced_backend",
    "pre_ampere_reason",
    "reason",
    "run",
    "select",
    "use_backend",
]

ENV_VAR = "FLASH_RECIPE_BACKEND"

# Priority order for automatic selection.
BACKENDS: list[Backend] = [FlashAttnBackend(), TritonBackend(), SdpaBackend(), ReferenceBackend()]
_BY_NAME = {backend.name: backend for backend in BACKENDS}
_ENVIRONMENT = object()  # no ``use_backend`` in this context: the environment variable decides
# The backend chosen by ``use_backend`` (None: automatic). A context variable, so that threads and
# asyncio tasks each keep their own choice.
_CHOICE: contextvars.ContextVar = contextvars.ContextVar("flash_recipe_backend", default=_ENVIRONMENT)
# The same choice per thread, for torch.compile: Dynamo cannot read a context variable, but it
# traces an attribute of a thread-local and guards on it, so a new choice retraces.
_TRACED = threading.local()


def backend_names() -> list[str]:
    return [backend.name for backend in BACKENDS]


def deterministic_backends() -> list[str]:
    """Names of the backends whose results are the same bytes on every run."""
    return [backend.name for backend in BACKENDS if backend.deterministic]


def _check_name(name: str) -> str:
    if name not in _BY_NAME:
        raise ValueError(f"backend must be one of {backend_names()} or 'auto', got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """Run the calls inside the ``with`` block on backend ``name`` (``None`` or ``"auto"``: automatic).

    Takes precedence over the ``FLASH_RECIPE_BACKEND`` environment variable. A call that the
    chosen backend cannot run raises ``BackendUnavailableError`` with the reason. The choice
    belongs to the current thread (or asyncio task): another thread's calls are not affected.
    """
    choice = None if name in (None, "auto") else _check_name(name)
    token = _CHOICE.set(choice)
    previous, _TRACED.choice = getattr(_TRACED, "choice", _ENVIRONMENT), choice
    try:
        yield
    finally:
        _TRACED.choice = previous
        _CHOICE.reset(token)


def forced_backend() -> Optional[str]:
    """The explicitly chosen backend, from ``use_backend`` or ``FLASH_RECIPE_BACKEND``, or None."""
    return _forced(torch.compiler.is_compiling())


def _forced(compiling: bool) -> Optional[str]:
    forced = getattr(_TRACED, "choice", _ENVIRONMENT) if compiling else _CHOICE.get()
    if forced is not _ENVIRONMENT:
        return forced
    name = getenv(ENV_VAR).strip()
    if name in ("", "auto"):
        return None
    if name not in _BY_NAME:
        raise ValueError(f"{ENV_VAR} must be one of {backend_names()} or 'auto', got {name!r}")
    return name


Refusal = Optional[Callable[[Backend], Optional[str]]]


def reason(backend: Backend, call: AttentionCall, extra: Refusal = None) -> Optional[str]:
    """Why ``backend`` cannot run ``call`` (None if it can); ``extra(backend)`` may add a reason."""
    return backend.is_available() or backend.supports(call) or (extra(backend) if extra is not None else None)


def explain_call(call: AttentionCall, extra: Refusal = None) -> dict[str, Optional[str]]:
    """Per backend, in priority order: None if it can run ``call``, else the reason."""
    return {backend.name: reason(backend, call, extra) for backend in BACKENDS}


def select(call: AttentionCall, extra: Refusal = None, extra_key: Optional[tuple] = None) -> Backend:
    """The backend that runs ``call``: the forced one (or an error), else the first that can.

    ``extra(backend)``: an optional further reason to refuse a backend (None if it can), which
    reads only what ``extra_key`` holds (with ``extra`` and no ``extra_key`` nothing is memoized).

    The choice is memoized per signature of the call (``flash_recipe.memo_keys``), forced backend
    and the process facts that change at run time (the ``flash_attn`` stand-in, the interpreter);
    the facts computed once per process are constant. ``memo_keys.forget()`` clears it.
    """
    # A signed call was built outside torch.compile (``signed``): no need to ask.
    compiling = call.signature is None and torch.compiler.is_compiling()
    name = _forced(compiling)
    key = None
    if not compiling and (extra is None or extra_key is not None):
        key = _selection_key(call, name, extra_key)
        found = _SELECTED.get(key) if key is not None else None
        if found is not None:
            return found
    backend = _choose(call, name, extra)
    if key is not None:  # never while compiling: the memo is this process's, not the graph's
        _SELECTED.keep(key, backend)
    return backend


def _choose(call: AttentionCall, name: Optional[str], extra: Refusal) -> Backend:
    """``select``'s choice, made in full: the forced backend ``name`` (or an error), else the first that can."""
    if name is not None:
        backend = _BY_NAME[name]
        why = reason(backend, call, extra)
        if why is not None:
            raise BackendUnavailableError(f"backend {name!r} cannot run this call: {why}")
        return backend
    for backend in BACKENDS:
        if reason(backend, call, extra) is None:
            return backend
    raise BackendUnavailableError(f"no backend can run this call: {explain_call(call, extra)}")  # reference always can


# (signature of a call, forced backend, run-time facts) -> the backend ``select`` chose.
_SELECTED = Memo()


def _selection_key(call: AttentionCall, forced: Optional[str], extra_key: Optional[tuple]) -> Optional[tuple]:
    """What a backend's refusal reads: the call's tensors and options (the token of the public layer's
    signature of its arguments, where it has one: ``memo_keys.TOKENS``), and the facts that can change."""
    found = call.signature
    if found is None:  # every field of the call (``CALL_FIELDS``), none by hand
        found = signature(CALL_FIELDS.tensors_of(call), CALL_FIELDS.values_of(call))
    if found is None:
        return None
    # The interpreter decides for CPU tensors only (``TritonBackend.supports``).
    interpreted = not call.q.is_cuda and targets.interpreter_enabled()
    return found, extra_key, forced, alias.is_installed(), interpreted


def select_cache(call: CacheCall) -> Backend:
    """The backend that runs a ``flash_attn_with_kvcache`` call."""
    rotary = call.rotary[0].dtype if call.rotary is not None else None
    return select(
        call.attention,
        lambda backend: backend.supports_cache(call),
        ("cache", call.paged, call.k_cache.shape[1], rotary),
    )


def select_paged(call: PagedCall) -> Backend:
    """The backend that runs a varlen call with paged keys."""
    return select(call.attention, lambda backend: backend.supports_paged(call), ("paged",))


def run(call: AttentionCall) -> tuple:
    """``(out, lse or None, dropped-out probabilities or None)`` from the selected backend."""
    return select(call).run_call(call)


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (for some call), in priority order."""
    return [backend.name for backend in BACKENDS if backend.is_available() is None]
