"""Backend registry and selection.

A backend answers two questions: ``is_available()`` (can it run on this machine at all?) and
``supports(call)`` (can it run this call?); each returns ``None`` for yes or a short reason for
no. Automatic selection walks ``BACKENDS`` in priority order and takes the first that can run.
An explicit choice (``use_backend("triton")`` or ``FLASH_RECIPE_BACKEND=triton``) that cannot run
raises ``BackendUnavailableError`` listing the reason. The same reasons feed ``explain()`` and
``flash-recipe doctor``.

Nothing here imports Triton or flash-attn, compiles or probes anything until a call needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
from typing import Iterator, Optional

import torch

from flash_recipe.ops.configs import interpreter_enabled, interpreter_imported_late

ENV_VAR = "FLASH_RECIPE_BACKEND"
# torch SDPA takes enable_gqa from torch 2.5 on; older releases get repeated kv heads.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
HALF_DTYPES = (torch.float16, torch.bfloat16)


class BackendUnavailableError(NotImplementedError):
    """The backend chosen explicitly cannot run this call (the message says why)."""


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call in flash-attn's layout, validated by ``flash_recipe.api``.

    ``q (B, Sq, H, D)``, ``k (B, Sk, Hk, D)``, ``v (B, Sk, Hk, Dv)``; query ``i`` sees key ``j``
    iff ``i + diag_offset - left <= j <= i + diag_offset + right`` for ``window = (left, right)``
    (``-1``: unbounded; ``causal`` implies ``right = 0``). ``attn_mask`` (broadcastable to ``(B, H, Sq, Sk)``)
    comes from the SDPA API only. ``return_lse`` asks for the log-sum-exp (and, with dropout, for
    the dropped-out probabilities, as flash-attn's ``return_attn_probs``).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float
    causal: bool = False
    diag_offset: int = 0
    window: tuple = (-1, -1)  # (left, right) around the diagonal, -1 unbounded; causal has right 0
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None  # float32 (H,) or (B, H)
    attn_mask: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    return_lse: bool = False
    # Varlen: q (total_q, H, D), k/v (total_k, Hk, D); int32 (B + 1,) offsets; diagonals bottom-right.
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def sequences(self) -> list:
        """A varlen call as one dense call per sequence (for backends without varlen kernels)."""
        starts_q = self.cu_seqlens_q.tolist()
        starts_k = self.cu_seqlens_k.tolist()
        calls = []
        for b in range(len(starts_q) - 1):
            q = self.q[starts_q[b]:starts_q[b + 1]].unsqueeze(0)
            k, v = (t[starts_k[b]:starts_k[b + 1]].unsqueeze(0) for t in (self.k, self.v))
            slopes = self.alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[b:b + 1]
            calls.append(dataclasses.replace(
                self, q=q, k=k, v=v, diag_offset=k.shape[1] - q.shape[1], alibi_slopes=slopes,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
            ))
        return calls


class Backend:
    """Base class: subclasses set ``name`` and implement the three methods.

    A backend without varlen kernels (``native_varlen = False``) runs varlen calls one sequence
    at a time.
    """

    name = ""
    native_varlen = False

    def is_available(self) -> Optional[str]:
        return None

    def supports(self, call: AttentionCall) -> Optional[str]:
        raise NotImplementedError

    def run(self, call: AttentionCall) -> tuple:
        """Return ``out (B, Sq, H, Dv)`` in q's dtype and, if asked, ``lse (B, H, Sq)`` float32 and,
        with dropout, the probabilities ``(B, H, Sq, Sk)``, negative where dropped (else None)."""
        raise NotImplementedError

    def run_call(self, call: AttentionCall) -> tuple:
        """``run``, with varlen calls split per sequence where the backend has no varlen kernel.

        Varlen results are ``out (total_q, H, Dv)`` and ``lse (H, total_q)``.
        """
        if not call.is_varlen or self.native_varlen:
            return self.run(call)
        results = [self.run(part) for part in call.sequences()]
        out = torch.cat([r[0].squeeze(0) for r in results], dim=0)
        lse = torch.cat([r[1].squeeze(0) for r in results], dim=1) if call.return_lse else None
        return out, lse, None



def _constant_under_compile(fn):
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does.

    The probes below are facts about the process, not about a call: torch.compile runs them while
    tracing and keeps their results as constants instead of tracing into imports. The mark is set
    directly because ``torch.compiler.assume_constant_result`` imports torch._dynamo (and with it
    Triton, over a second), which importing flash_recipe must not do. tests/test_torch_compile.py
    fails if torch stops honouring the mark.
    """
    fn._dynamo_marked_constant = True
    return fn



@functools.lru_cache(maxsize=None)
@_constant_under_compile
def _import_error(module: str) -> Optional[str]:
    """None if ``module`` imports, else the reason as text (cached: imports are costly)."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install raises anything from ImportError to OSError
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=None)
@_constant_under_compile
def _triton_too_old() -> Optional[str]:
    """Why the imported Triton is older than the kernels support, or None."""
    import triton

    from flash_recipe.env import versions

    release = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    if release >= versions.TRITON_MIN:
        return None
    oldest = ".".join(map(str, versions.TRITON_MIN))
    return (f"Triton {triton.__version__} is older than {oldest}, the oldest these kernels support; Triton comes "
            f"with torch: upgrade torch to {'.'.join(map(str, versions.TORCH_MIN))} or newer "
            f"(flash-recipe doctor prints the command for your installer)")


@functools.lru_cache(maxsize=None)
@_constant_under_compile
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@_constant_under_compile
def _interpreter_problem() -> Optional[str]:
    """Why the Triton interpreter cannot run CPU tensors now, or None if it can."""
    if not interpreter_enabled():
        return "tensors are on the CPU; Triton runs there only through its interpreter (TRITON_INTERPRET=1)"
    if interpreter_imported_late():
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import of triton"
    return None


def _device_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
@_constant_under_compile
def _configs_problem(index: int) -> Optional[str]:
    """Why flash_recipe's launch configurations cannot serve GPU ``index``, or None.

    A GPU the configuration tables do not know gets their most conservative family; this refuses
    an architecture no family serves (NVIDIA below sm80, AMD other than CDNA) and a GPU that
    reports less shared memory per block (``shared_memory_per_block_optin``) than its family needs.
    """
    from flash_recipe.ops import configs

    target = configs.gpu_target(index)
    try:
        configs.arch_family(target)
    except ValueError as exc:
        return str(exc)
    available = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    if not available:
        return None  # this torch does not report it; the known targets are checked offline
    return configs.shared_memory_problem(target, available)


# Turing (sm75: T4, RTX 20xx) and older. The doctor's gpu-too-old finding says the same.
TURING_ISSUES = "#330, #542, #720, #887"


def pre_ampere_reason(major: int, minor: int) -> str:
    """Why neither these Triton kernels nor upstream flash-attn 2 run on a GPU below sm80."""
    return (
        f"GPU compute capability {major}.{minor} (sm{major}{minor}) is below 8.0: Triton has no tensor-core path "
        f"there (it lowers tl.dot to FMA instructions on sm75 and older), so these kernels need sm80 or newer; "
        f"upstream flash-attn 2 has no Turing support either (flash-attention issues {TURING_ISSUES}). "
        f"The sdpa backend runs such calls with torch's memory-efficient kernel"
    )


def _pre_ampere_nvidia(device: torch.device) -> bool:
    """A CUDA device below sm80 (torch SDPA has no flash kernel there)."""
    return device.type == "cuda" and torch.version.hip is None and _device_capability(device) < (8, 0)


class TritonBackend(Backend):
    """This package's Triton kernels (``flash_recipe.ops``)."""

    name = "triton"
    native_varlen = True

    def is_available(self) -> Optional[str]:
        error = _import_error("triton")
        if error == "triton is not installed":
            return f"{error} (Triton publishes wheels for Linux x86_64 and aarch64 only)"
        if error is not None:
            return f"triton fails to import: {error}"
        return _triton_too_old()

    def supports(self, call: AttentionCall) -> Optional[str]:
        q, k, v = call.q, call.k, call.v
        if q.device.type == "cpu":
            problem = _interpreter_problem()
            if problem is not None:
                return problem
            if q.dtype == torch.bfloat16:
                return "the Triton interpreter computes bfloat16 dot products incorrectly; use float16 or float32 on the CPU"
        elif q.device.type == "cuda":
            if torch.version.hip is None:
                major, minor = _device_capability(q.device)
                if major < 8:
                    return pre_ampere_reason(major, minor)
            problem = _configs_problem(q.device.index if q.device.index is not None else torch.cuda.current_device())
            if problem is not None:
                return problem
        else:
            return f"device type {q.device.type!r} is not supported (cuda or, with the interpreter, cpu)"
        if v.shape[-1] != q.shape[-1]:
            return f"value head dim {v.shape[-1]} differs from query head dim {q.shape[-1]}"
        if q.shape[-1] > 256:
            return f"head dim {q.shape[-1]} is above 256"
        if call.attn_mask is not None:
            return "an explicit attn_mask is not supported (causal masking is)"
        if call.dropout_p > 0.0 and call.return_lse and call.is_varlen:
            return "the dropped-out probabilities are returned for dense calls only"
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            return "the last dimension of q, k and v must be contiguous"
        return None

    def run(self, call: AttentionCall):
        from flash_recipe.ops.attention import attention, new_seed

        window = (call.window[0], 0 if call.causal else call.window[1])
        seed = new_seed(call.q.device) if call.dropout_p > 0.0 else None
        out, lse = attention(call.q, call.k, call.v, call.softmax_scale, call.diag_offset, window, call.softcap,
                             call.alibi_slopes, (call.cu_seqlens_q, call.cu_seqlens_k),
                             (call.max_seqlen_q, call.max_seqlen_k), call.dropout_p, seed)
        s_dmask = None
        if seed is not None and call.return_lse:
            s_dmask = self._dropped_probs(call, window, seed)
        return out, lse, s_dmask

    @staticmethod
    def _dropped_probs(call: AttentionCall, window, seed) -> torch.Tensor:
        """The probabilities ``(B, H, Sq, Sk)`` the kernel used, negated where dropout dropped them."""
        from flash_recipe.ops.dropout import dropout_mask
        from flash_recipe.reference import attention_reference

        batch, seqlen_q, nheads, _ = call.q.shape
        keep = dropout_mask(seed, batch, nheads, seqlen_q, call.k.shape[1], call.dropout_p)
        with torch.no_grad():
            _, probs = attention_reference(
                call.q, call.k, call.v, call.softmax_scale, call.causal, call.diag_offset, window=window,
                softcap=call.softcap, alibi_slopes=call.alibi_slopes, return_probs=True,
            )
        return torch.where(keep, probs, -probs).to(call.q.dtype)


class FlashAttnBackend(Backend):
    """The upstream flash-attn 2 package, when installed and its compiled kernels load."""

    name = "flash_attn"
    native_varlen = True

    def is_available(self) -> Optional[str]:
        if _import_error("flash_attn") == "flash_attn is not installed":
            return "flash_attn is not installed"
        error = _import_error("flash_attn_2_cuda")
        if error is not None:
            return f"flash_attn is installed but its compiled module does not load ({error})"
        return None

    def supports(self, call: AttentionCall) -> Optional[str]:
        q, k, v = call.q, call.k, call.v
        if q.device.type != "cuda" or torch.version.hip is not None:
            return "flash_attn runs on NVIDIA GPUs only"
        if q.dtype not in HALF_DTYPES:
            return f"flash_attn supports float16 and bfloat16 only, got {q.dtype}"
        major, minor = _device_capability(q.device)
        if major < 8:
            return (
                f"flash_attn 2 needs compute capability 8.0 (Ampere) or newer, this GPU has {major}.{minor}; "
                f"it has no Turing support (flash-attention issues {TURING_ISSUES})"
            )
        if v.shape[-1] != q.shape[-1] or q.shape[-1] > 256:
            return "flash_attn needs equal query and value head dims of at most 256"
        if call.causal and call.diag_offset != k.shape[1] - q.shape[1]:
            return "flash_attn aligns the causal mask bottom-right only"
        if call.attn_mask is not None:
            return "flash_attn takes no explicit attn_mask"
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            return "the last dimension of q, k and v must be contiguous"
        return None

    def run(self, call: AttentionCall):
        import flash_attn

        if call.is_varlen:
            fn = functools.partial(flash_attn.flash_attn_varlen_func, cu_seqlens_q=call.cu_seqlens_q,
                                   cu_seqlens_k=call.cu_seqlens_k, max_seqlen_q=call.max_seqlen_q,
                                   max_seqlen_k=call.max_seqlen_k)
        else:
            fn = flash_attn.flash_attn_func
        result = fn(
            call.q, call.k, call.v, dropout_p=call.dropout_p, softmax_scale=call.softmax_scale,
            causal=call.causal, window_size=call.window, softcap=call.softcap, alibi_slopes=call.alibi_slopes,
            return_attn_probs=call.return_lse,
        )
        if call.return_lse:
            return result[0], result[1], result[2]
        return result, None, None


class SdpaBackend(Backend):
    """``torch.nn.functional.scaled_dot_product_attention``.

    torch picks its own kernel, except on NVIDIA GPUs below sm80 (T4, RTX 20xx), where torch's
    flash kernel does not exist: there the call is restricted to the memory-efficient kernel (with
    math as the last resort), so an enclosing ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])`` cannot
    make it fail with "No available kernel", and it is shaped so that kernel takes it: key/value
    heads repeated for GQA (the kernel has no GQA) and bfloat16 computed in float32 (the kernel
    takes float16 and float32 only below sm80; the result is cast back).
    """

    name = "sdpa"

    def supports(self, call: AttentionCall) -> Optional[str]:
        if call.return_lse:
            return "torch SDPA does not return the log-sum-exp"
        if call.softcap > 0.0:
            return "torch SDPA has no softcap"
        if not call.is_varlen and call.k.shape[1] == 0:
            return "no keys (seqlen_k = 0)"
        return None

    def run(self, call: AttentionCall):
        from flash_recipe.reference import alibi_bias, visible_keys

        q, k, v = (t.transpose(1, 2) for t in (call.q, call.k, call.v))  # (B, H, S, D) views
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        if seqlen_k == 0:  # rows that see no key output 0
            return call.q.new_zeros(call.q.shape[:-1] + (call.v.shape[-1],)), None, None
        mask, is_causal = call.attn_mask, False
        efficient_only = _pre_ampere_nvidia(q.device)
        if efficient_only and q.dtype == torch.bfloat16:
            q, k, v = (t.float() for t in (q, k, v))
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.float()
        window = (call.window[0], 0 if call.causal else call.window[1])
        if call.causal and call.diag_offset == 0 and window[0] < 0 and mask is None and call.alibi_slopes is None:
            is_causal = True
        elif window != (-1, -1):
            visible = visible_keys(seqlen_q, seqlen_k, call.diag_offset, window, q.device)
            mask = visible if mask is None else _combine_masks(visible, mask)
        if call.alibi_slopes is not None:
            bias = alibi_bias(call.alibi_slopes, seqlen_q, seqlen_k, call.diag_offset).to(q.dtype)
            if mask is None:
                mask = bias
            elif mask.dtype == torch.bool:
                mask = _combine_masks(mask, bias)
            else:
                mask = mask + bias
        options = dict(attn_mask=mask, dropout_p=call.dropout_p, is_causal=is_causal, scale=call.softmax_scale)
        if q.shape[1] != k.shape[1]:
            if _SDPA_HAS_GQA and not efficient_only:
                options["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if efficient_only:
            with _efficient_sdpa_kernels():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
            out = out.to(call.q.dtype).transpose(1, 2)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options).transpose(1, 2)
        left, right = window
        first_row_blind = right >= 0 and call.diag_offset + right < 0
        last_row_blind = left >= 0 and seqlen_q - 1 + call.diag_offset - left >= seqlen_k
        if first_row_blind or last_row_blind:
            # Rows that see no key: some torch kernels give NaN there, flash-attn gives 0.
            visible = visible_keys(seqlen_q, seqlen_k, call.diag_offset, window, q.device)
            out = out.masked_fill(~visible.any(dim=-1)[None, :, None, None], 0.0)
        return out, None, None


def _efficient_sdpa_kernels():
    """torch SDPA restricted to its memory-efficient kernel, math as the last resort."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _combine_masks(visible: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Restrict ``mask`` (bool or additive) to the ``visible`` bool mask."""
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, float("-inf"))


class ReferenceBackend(Backend):
    """``flash_recipe.reference`` in fp32 (fp64 for fp32 inputs): slow, always correct."""

    name = "reference"

    def supports(self, call: AttentionCall) -> Optional[str]:
        if call.dropout_p > 0.0 and call.return_lse:
            return "the reference draws dropout from torch's RNG and cannot return the dropped-out probabilities"
        return None

    def run(self, call: AttentionCall):
        from flash_recipe.reference import attention_reference

        out, lse = attention_reference(
            call.q, call.k, call.v, call.softmax_scale, call.causal, call.diag_offset,
            attn_mask=call.attn_mask, dropout_p=call.dropout_p,
            window=call.window, softcap=call.softcap, alibi_slopes=call.alibi_slopes,
        )
        return out.to(call.q.dtype), (lse if call.return_lse else None), None


# Priority order for automatic selection.
BACKENDS: list[Backend] = [FlashAttnBackend(), TritonBackend(), SdpaBackend(), ReferenceBackend()]
_BY_NAME = {backend.name: backend for backend in BACKENDS}
_forced: list[Optional[str]] = []


def backend_names() -> list[str]:
    return [backend.name for backend in BACKENDS]


def _check_name(name: str) -> str:
    if name not in _BY_NAME:
        raise ValueError(f"backend must be one of {backend_names()} or 'auto', got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """Run the calls inside the ``with`` block on backend ``name`` (``None`` or ``"auto"``: automatic).

    Takes precedence over the ``FLASH_RECIPE_BACKEND`` environment variable. A call that the
    chosen backend cannot run raises ``BackendUnavailableError`` with the reason.
    """
    _forced.append(None if name in (None, "auto") else _check_name(name))
    try:
        yield
    finally:
        _forced.pop()


def forced_backend() -> Optional[str]:
    """The explicitly chosen backend, from ``use_backend`` or ``FLASH_RECIPE_BACKEND``, or None."""
    if _forced:
        return _forced[-1]
    name = os.environ.get(ENV_VAR, "").strip()
    if name in ("", "auto"):
        return None
    if name not in _BY_NAME:
        raise ValueError(f"{ENV_VAR} must be one of {backend_names()} or 'auto', got {name!r}")
    return name


def reason(backend: Backend, call: AttentionCall, extra=None) -> Optional[str]:
    """Why ``backend`` cannot run ``call`` (None if it can); ``extra(backend)`` may add a reason."""
    return backend.is_available() or backend.supports(call) or (extra(backend) if extra is not None else None)


def explain_call(call: AttentionCall, extra=None) -> dict[str, Optional[str]]:
    """Per backend, in priority order: None if it can run ``call``, else the reason."""
    return {backend.name: reason(backend, call, extra) for backend in BACKENDS}


def select(call: AttentionCall, extra=None) -> Backend:
    """The backend that runs ``call``: the forced one (or an error), else the first that can.

    ``extra(backend)``: an optional further reason to refuse a backend (None if it can).
    """
    name = forced_backend()
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


def run(call: AttentionCall) -> tuple:
    """``(out, lse or None, dropped-out probabilities or None)`` from the selected backend."""
    return select(call).run_call(call)


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (for some call), in priority order."""
    return [backend.name for backend in BACKENDS if backend.is_available() is None]
