"""Call signatures and the memos keyed by them: what lets a repeated call skip the work it did once.

A decoding loop calls attention with the same shapes thousands of times. Everything that follows
from a call's *signature* (its tensors' shapes, strides, dtypes and devices, and its option values
with their types) is the same every time: the checks' verdict, the backend chosen, the launch
configuration, grid and scalar arguments. Each layer keeps what it derived in a ``Memo`` keyed by
the signature, so the first call of a signature does all the work and the next ones look it up.

What must never be memoized: anything that reads tensor *values* (metadata on the host is checked
on every call) or depends on data pointers (alignment, tensor descriptors). ``signature`` returns
None for arguments it cannot key faithfully (a tensor subclass, an unhashable option), and the
caller then takes the full path.

A key never lists a record's fields by hand: ``Fields`` derives which fields of an options record
(``ScoreOptions``, ``AttentionCall``, ``FlashOptions``...) are tensors and which are values, so a
field added to a record reaches every key built from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
import weakref
from operator import attrgetter
from typing import Any, Callable, Optional

import torch

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def signature(tensors: tuple, options: tuple) -> Optional[tuple]:
    """A hashable key for ``tensors`` (each a plain ``torch.Tensor``, an ``nn.Parameter`` such as a
    model's attention sinks, or None) and ``options``, or None.

    A tensor contributes ``(shape, stride, dtype, device)``; an option ``(type, value)``, so that
    ``True`` and ``1``, or ``0`` and ``0.0``, which compare equal, never share a key (the checks treat
    them differently). A tuple or list option contributes its items' types too. Returns None when a
    tensor is a subclass or another type, or an option is not hashable: such calls are not memoized.
    """
    key: list = []
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is _Tensor or type(t) is _Parameter:
            key.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    for value in options:
        kind = type(value)
        if kind is tuple or kind is list:
            key.append((kind, tuple(value), tuple(map(type, value))))
        elif kind is _Tensor:
            return None
        else:
            key.append((kind, value))
    result = tuple(key)
    try:
        hash(result)
    except TypeError:
        return None
    return result


# Signature tokens. The public layer memoizes each call signature it checked under a new token
# (``next(TOKENS)``: a C call, no Python frame) and signs the call with it (``AttentionCall.signed``);
# the layers below key their memos by the token. A token stands for its signature: whatever a
# signature decides, its token decides. It is an int, which hashes at no cost, where the signature it
# stands for has some twenty parts that every lookup would hash again. Never reused in the process,
# so a signature memoized anew (after its memo was emptied) gets a new token, and a stale entry keyed
# by the old one is never hit.
TOKENS = itertools.count(1)


class Fields:
    """The fields of a record type (a NamedTuple or a dataclass), split as ``signature`` takes them.

    ``tensors``: the names of the fields annotated ``torch.Tensor`` or ``Optional[torch.Tensor]``;
    ``values``: the others; each in field order. A dataclass field with ``compare=False`` (such as
    ``AttentionCall.signature``) is not part of the record and is left out.

    ``tensors_of(record)`` and ``values_of(record)`` return a record's fields of each kind as a
    tuple (an ``operator.attrgetter`` for two fields or more: no Python frame, about what a tuple
    of the fields written by hand costs). A key adds an optional record's parts only when it is
    there (``if varlen is not None: tensors += ...``), telling apart the calls that have it.
    """

    __slots__ = ("tensors", "values", "tensors_of", "values_of")

    def __init__(self, record: type) -> None:
        if dataclasses.is_dataclass(record):
            names = [f.name for f in dataclasses.fields(record) if f.compare]
        else:
            names = list(record._fields)  # type: ignore[attr-defined]
        hints = typing.get_type_hints(record)
        self.tensors = tuple(name for name in names if _annotated_tensor(hints[name]))
        self.values = tuple(name for name in names if name not in self.tensors)
        self.tensors_of = _getter(self.tensors)
        self.values_of = _getter(self.values)


def _annotated_tensor(hint: Any) -> bool:
    """Whether a resolved annotation is ``torch.Tensor`` or a union with it (``Optional[torch.Tensor]``)."""
    return hint is _Tensor or _Tensor in typing.get_args(hint)


def _getter(names: tuple) -> Callable[[Any], tuple]:
    """A function of a record that returns its fields ``names`` as a tuple (``attrgetter`` returns
    the bare value for one name and takes no empty list)."""
    if not names:
        return lambda record: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda record: (one(record),)
    return attrgetter(*names)


class Memo(dict):
    """A dict of results per signature that forgets everything when it holds ``limit`` entries
    (a program that calls with ever new shapes keeps a bounded memo; one that repeats its shapes,
    the case it serves, never reaches the limit)."""

    def __init__(self, limit: int = 1024) -> None:
        super().__init__()
        self.limit = limit
        _MEMOS.append(weakref.ref(self))

    def keep(self, key: Any, value: Any) -> Any:
        """Store ``value`` under ``key`` (unless ``key`` is None) and return it."""
        if key is not None:
            if len(self) >= self.limit:
                self.clear()
            self[key] = value
        return value


_MEMOS: list = []  # weak references to every Memo (a dict is not hashable: no WeakSet)

# ``(kind, batch, device)`` -> the int32 index tensor ``shared_index`` made: kept for the process and
# never cleared, since a CUDA graph captured after it was made holds its address. Read as
# ``SHARED_INDEXES.get(...)`` by the callers (no Python frame); bounded by ``SHARED_INDEXES_LIMIT``.
SHARED_INDEXES: dict = {}
SHARED_INDEXES_LIMIT = 4096


def shared_index(kind: str, batch: int, device: torch.device) -> torch.Tensor:
    """An int32 index that depends on a call's signature alone, made once for every later call to
    share instead of computing it each time: ``"zeros"``, ``(batch,)`` of zeros (no left padding),
    or ``"rows"``, ``(batch, 1)`` holding ``b`` in row ``b`` (entry ``b`` at cache row ``b``).

    A kept index is written before it is returned (on a GPU the current stream is synchronised,
    once), so a launch on any stream and a CUDA graph captured later may read it; it stays in
    ``SHARED_INDEXES`` for the process. Not kept, and made for this call alone: while a CUDA graph is
    being captured (its kernels run only at replay) or torch.compile traces, or past the limit.
    """
    if kind == "zeros":
        index = torch.zeros(batch, dtype=torch.int32, device=device)
    elif kind == "rows":
        index = torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)
    else:
        raise ValueError(f"kind must be 'zeros' or 'rows', got {kind!r}")
    if not _may_keep(device) or len(SHARED_INDEXES) >= SHARED_INDEXES_LIMIT:
        return index
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    # The first index kept for a key stays: one another thread made meanwhile is never replaced.
    return SHARED_INDEXES.setdefault((kind, batch, device), index)


def _may_keep(device: torch.device) -> bool:
    """Whether a tensor made now on ``device`` may outlive the call: not while torch.compile traces
    (a traced tensor is not a real one) nor while ``device``'s current stream is being captured."""
    if torch.compiler.is_compiling():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def forget() -> None:
    """Empty every memo: the next call of any signature takes the full path again (after a change
    to what the checks read, such as ``validate.on_host`` standing in for device memory)."""
    _MEMOS[:] = [ref for ref in _MEMOS if ref() is not None]
    for ref in _MEMOS:
        memo = ref()
        if memo is not None:
            memo.clear()
