"""Environment variables that a call reads each time it runs, read in one Python frame.

A setting such as ``FLASH_RECIPE_BACKEND`` takes effect on the next call, so the call path reads it
on every call. ``os.environ.get(name)`` runs three or four Python functions to do that (the
``Mapping`` mixin's ``get``, ``__getitem__``, the key's encoding and the value's decoding), which a
decoding loop pays on every layer of every token. ``getenv(name)`` looks the encoded name up in
the dict behind ``os.environ`` (``os._Environ``'s ``_data``, which every assignment to
``os.environ``, ``os.putenv`` aside, updates) and decodes the value the way ``os.environ`` does;
where that dict is not there (another Python, ``os.environ`` replaced by a plain mapping), it
falls back to ``os.environ.get``.
"""

from __future__ import annotations

import os
import sys

# Each name as os.environ's store keys it (bytes on POSIX, upper-case str on Windows).
_KEYS: dict = {}


def getenv(name: str, default: str = "") -> str:
    """``os.environ.get(name, default)``, without its Python frames where CPython allows."""
    environ = os.environ
    store = getattr(environ, "_data", None)
    encode = getattr(environ, "encodekey", None)
    if type(store) is not dict or encode is None:
        return environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = encode(name)
    value = store.get(key)
    if value is None:
        return default
    return value.decode(sys.getfilesystemencoding(), "surrogateescape") if type(value) is bytes else value
