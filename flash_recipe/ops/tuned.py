"""Tuned launch configurations: the per-device cache that ``flash-recipe tune`` writes and the launchers read.

``choose.launch_config`` asks this module first (after an ``overriding`` block) and falls back to
the table, so a machine that never tuned runs exactly the table's configurations. Nothing here
applies on the CPU or under ``TRITON_INTERPRET``: the callers ask only for a GPU target.

Where the cache lives: one JSON file per GPU model, ``<directory>/<GPU name>.tune.json`` (the name
as ``torch.cuda.get_device_name`` reports it, with every run of characters other than letters,
digits, ``.``, ``_`` and ``-`` replaced by ``-``), in the directory ``$FLASH_RECIPE_TUNE_CACHE``
if that is set and not empty, else ``$XDG_CACHE_HOME/flash-recipe/tune``, else
``~/.cache/flash-recipe/tune``. Deleting the files (``flash-recipe tune --clear``) returns to the
table.

The format (``FORMAT`` 1)::

    {"format": 1,
     "key": {"gpu": "NVIDIA H100 80GB HBM3", "target": "sm90", "triton": "3.4.0", "flash_recipe": "0.1.0"},
     "configs": [{"kernel": "fwd", "head_dim": 128, "element_size": 2,
                  "block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, ...}],
     "num_splits": [{"head_dim": 128, "element_size": 2, "programs": 64, "cache_len": 8192,
                     "num_splits": 8, ...}],
     "backward": [{"head_dim": 128, "element_size": 2, "path": "three_kernels", ...}]}

- ``key``: the file applies only to a GPU of that name and compile target, with that Triton and
  flash_recipe version; a file with another key is stale (a Triton upgrade changes the code a
  configuration compiles to) and is ignored.
- ``configs``: the launch configuration per ``(kernel, head-dim bucket, element size)``, the
  table's own key (``configs.get_config``). Blocks are powers of two from 16 to 256.
- ``num_splits``: the split-KV count for a decoding step (``kvcache.auto_splits``) per head-dim
  bucket, element size, ``programs`` (``batch * nheads * cdiv(seqlen_q, 16)``) and ``cache_len``
  (the cache's capacity in rows), the last two rounded up to a power of two; 0 means the
  heuristic was measured as fast as any count, and stays.
- ``backward`` (optional): the backward's path (``"one_pass"`` or ``"three_kernels"``) per
  head-dim bucket and element size, where the GPU measured it faster than the family's default
  (``configs.BACKWARD_PATHS``, ``choose.backward_path``); ``deterministic=True`` ignores it.
- any other field (timings, the shapes measured) is informational and not read.

A file that cannot be read (whatever is wrong with it, nesting too deep for the parser included),
is not this format, or is stale is ignored with one ``TunedCacheWarning`` per process, and the
table is used. A ``configs`` entry that cannot fit the GPU (``fits``: its pipelined tiles need more
shared memory than the GPU offers a block) is dropped with the same warning; the rest of the file
is used.

Measured defaults shipped in the wheel (``MEASURED_DIR``, ``flash_recipe/measured/``): files of
the same format and name, one per GPU model, written by the GPU campaign's shoot-out on that GPU
and committed (``flash_recipe/measured/README.md``). Where this machine has a file of its own, its
entries win, one lookup at a time; the shipped file's other entries still apply, and the table
serves the rest. A shipped file applies where its key's ``gpu`` and ``target`` are this GPU's,
under every Triton release (its key's ``triton`` says which release measured it): each entry is a
choice among configurations that the checks of this release accept as they accept the table's
(``fits``; a one-pass ``backward`` entry only under a release that compiles the one-pass tile
cleanly, ``configs.release_takes_one_pass``), and an entry that fails to compile or launch falls
back to the table (``choose.tuned_fallback``). A shipped file that cannot be read, or is keyed
for another GPU, is ignored with one ``TunedCacheWarning``, as a file of this machine's is.

Writers (``save``) hold an exclusive lock on ``<file>.lock`` beside the file while they read,
merge and replace it, so two tuners saving at once keep each other's entries. The file is read once per process and
device; changing ``FLASH_RECIPE_TUNE_CACHE`` (or ``XDG_CACHE_HOME``) makes the next launch read
the file it now names, and ``forget()`` drops what was read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Optional

from .. import __version__
from ..atomic_json import write_json
from . import configs, targets
from .limits import BACKWARD_PATH_NAMES, HEAD_DIM_BUCKETS, MAX_SPLITS

FORMAT = 1
ENV_VAR = "FLASH_RECIPE_TUNE_CACHE"
SUFFIX = ".tune.json"
KEY_FIELDS = ("gpu", "target", "triton", "flash_recipe")
# The measured defaults shipped in the wheel, and the key fields that must match for one to apply.
MEASURED_DIR = Path(__file__).resolve().parent.parent / "measured"
MEASURED_KEY_FIELDS = ("gpu", "target")
ELEMENT_SIZES = (2, 4)
BLOCK_SIZES = (16, 32, 64, 128, 256)
NUM_WARPS = (1, 2, 4, 8, 16)
MAX_STAGES = 8


class TunedCacheWarning(UserWarning):
    """A tuned-configuration file was ignored (unreadable, another format, or stale), or one of its
    entries failed to compile or launch (``choose.tuned_fallback``)."""


class BadCacheFile(ValueError):
    """Why a tuned-configuration file cannot be used."""


class Tuned(NamedTuple):
    """One cache file, checked.

    ``configs``: ``(kernel, head-dim bucket, element size) -> (block_m, block_n, num_warps,
    num_stages)``; ``splits``: ``(head-dim bucket, element size, programs bucket, cache-length
    bucket) -> num_splits``; ``paths``: ``(head-dim bucket, element size) -> backward path``;
    ``document``: the file's JSON as read.
    """

    key: dict
    configs: dict
    splits: dict
    paths: dict
    document: dict


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): the buckets of ``programs`` and ``cache_len``."""
    bucket = 1
    while bucket < n:
        bucket *= 2
    return bucket


# -- where ------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The directory of the cache files (see the module docstring)."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash-recipe" / "tune"


def file_name(gpu: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA-H100-80GB-HBM3.tune.json"``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", gpu).strip("-.") or "gpu"
    return slug + SUFFIX


def cache_path(gpu: str, directory: Optional[os.PathLike] = None) -> Path:
    """The cache file of GPU model ``gpu``, in ``directory`` (default ``cache_dir()``)."""
    return Path(directory if directory is not None else cache_dir()) / file_name(gpu)


def make_key(gpu: str, target: str) -> dict:
    """The key of a cache file for GPU model ``gpu`` (compile target ``target``) with the Triton and
    flash_recipe installed in this process."""
    import triton  # imported only to make a key: reading and checking a file needs no Triton

    return {"gpu": gpu, "target": target, "triton": triton.__version__, "flash_recipe": __version__}


# -- reading ----------------------------------------------------------------------------------


def _field(entry: dict, name: str, where: str, allowed=None, low: int = 1, high: Optional[int] = None) -> int:
    value = entry.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadCacheFile(f"{where}: {name} must be an integer, got {value!r}")
    if allowed is not None and value not in allowed:
        raise BadCacheFile(f"{where}: {name} must be one of {allowed}, got {value}")
    if value < low or (high is not None and value > high):
        raise BadCacheFile(f"{where}: {name} must be in [{low}, {high}], got {value}")
    return value


def _power_of_two(entry: dict, name: str, where: str) -> int:
    value = _field(entry, name, where)
    if value & (value - 1):
        raise BadCacheFile(f"{where}: {name} must be a power of two, got {value}")
    return value


def parse(document: Any) -> Tuned:
    """Check a cache file's JSON (everything but whether its key matches); raises ``BadCacheFile``."""
    if not isinstance(document, dict):
        raise BadCacheFile(f"the file holds a JSON {type(document).__name__}, not an object")
    if document.get("format") != FORMAT:
        raise BadCacheFile(f"format {document.get('format')!r}, expected {FORMAT}")
    key = document.get("key")
    if not isinstance(key, dict) or any(not isinstance(key.get(name), str) for name in KEY_FIELDS):
        raise BadCacheFile(f"key must be an object with the strings {', '.join(KEY_FIELDS)}, got {key!r}")
    found_configs, found_splits, found_paths = {}, {}, {}
    for section in ("configs", "num_splits", "backward"):
        if not isinstance(document.get(section, []), list):
            raise BadCacheFile(f"{section} must be a list, got {type(document[section]).__name__}")
    for i, entry in enumerate(document.get("configs", [])):
        where = f"configs[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("kernel"), str):
            raise BadCacheFile(f"{where}: must be an object with a kernel name, got {entry!r}")
        lookup = (entry["kernel"], _field(entry, "head_dim", where, HEAD_DIM_BUCKETS),
                  _field(entry, "element_size", where, ELEMENT_SIZES))
        config = (_field(entry, "block_m", where, BLOCK_SIZES), _field(entry, "block_n", where, BLOCK_SIZES),
                  _field(entry, "num_warps", where, NUM_WARPS), _field(entry, "num_stages", where, high=MAX_STAGES))
        if lookup in found_configs:
            raise BadCacheFile(f"{where}: a second entry for {lookup[0]} at head dim {lookup[1]}, "
                               f"{lookup[2]}-byte elements")
        found_configs[lookup] = config
    for i, entry in enumerate(document.get("num_splits", [])):
        where = f"num_splits[{i}]"
        if not isinstance(entry, dict):
            raise BadCacheFile(f"{where}: must be an object, got {entry!r}")
        lookup = (_field(entry, "head_dim", where, HEAD_DIM_BUCKETS),
                  _field(entry, "element_size", where, ELEMENT_SIZES),
                  _power_of_two(entry, "programs", where), _power_of_two(entry, "cache_len", where))
        if lookup in found_splits:
            raise BadCacheFile(f"{where}: a second entry for head dim {lookup[0]}, {lookup[1]}-byte elements, "
                               f"{lookup[2]} programs, cache length {lookup[3]}")
        found_splits[lookup] = _field(entry, "num_splits", where, low=0, high=MAX_SPLITS)
    for i, entry in enumerate(document.get("backward", [])):
        where = f"backward[{i}]"
        if not isinstance(entry, dict) or entry.get("path") not in BACKWARD_PATH_NAMES:
            raise BadCacheFile(f"{where}: must be an object whose path is one of {', '.join(BACKWARD_PATH_NAMES)}, "
                               f"got {entry!r}")
        lookup = (_field(entry, "head_dim", where, HEAD_DIM_BUCKETS),
                  _field(entry, "element_size", where, ELEMENT_SIZES))
        if lookup in found_paths:
            raise BadCacheFile(f"{where}: a second entry for head dim {lookup[0]}, {lookup[1]}-byte elements")
        found_paths[lookup] = entry["path"]
    return Tuned(dict(key), found_configs, found_splits, found_paths, document)


def read(path: os.PathLike) -> Tuned:
    """Read and check one cache file; raises ``FileNotFoundError`` or ``BadCacheFile``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise BadCacheFile(f"cannot be read ({exc})") from None
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise BadCacheFile(f"is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    return parse(document)


def shared_memory_floor(config, head_dim: int, element_size: int) -> int:
    """A lower bound, in bytes, of the shared memory a launch with ``config`` (``block_m, block_n,
    num_warps, num_stages``) at head-dim bucket ``head_dim`` needs: every kernel's main loop
    feeds a dot from a ``(block, head_dim)`` tile it loads, which Triton's software pipeline keeps
    in shared memory, one buffer per stage beyond the first (at least that of the smaller block)."""
    block_m, block_n, _, num_stages = config
    return (num_stages - 1) * min(block_m, block_n) * head_dim * element_size


def fits(tuned: Tuned, limit: Optional[int], gpu: str) -> tuple:
    """``tuned`` without the ``configs`` entries that cannot fit in ``limit`` bytes of shared
    memory per block (GPU ``gpu``'s), and a line per entry dropped. ``limit`` None keeps everything."""
    if not limit:
        return tuned, []
    kept, dropped = {}, []
    for (kernel, bucket, size), config in tuned.configs.items():
        need = shared_memory_floor(config, bucket, size)
        if need > limit:
            dropped.append(f"the {kernel} entry at head dim {bucket}, {size}-byte elements {tuple(config)} needs at "
                           f"least {need} bytes of shared memory, the {gpu} offers {limit} per block")
        else:
            kept[(kernel, bucket, size)] = config
    return tuned._replace(configs=kept), dropped


def key_problem(found: dict, expected: dict, fields: tuple = KEY_FIELDS) -> Optional[str]:
    """Why a file keyed ``found`` does not apply where ``expected`` is this process's key, or None;
    ``fields``: the key fields compared (``MEASURED_KEY_FIELDS`` for a shipped file)."""
    differ = [name for name in fields if found.get(name) != expected.get(name)]
    if not differ:
        return None
    return "it was tuned for " + ", ".join(f"{name} {found.get(name)!r}" for name in differ) + "; this is " + \
        ", ".join(f"{name} {expected.get(name)!r}" for name in differ)


# -- the lookup the launchers make ------------------------------------------------------------

_LOCK = threading.Lock()
_LOADED: dict = {}  # (device index, target, $FLASH_RECIPE_TUNE_CACHE, $XDG_CACHE_HOME) -> Tuned or None
_WARNED: set = set()  # paths already warned about
_NAMES: dict = {}  # device index -> GPU name
_REJECTED: set = set()  # (target, kernel, bucket, element size) of entries that failed to compile or launch


def _gpu_name(index: int) -> str:
    name = _NAMES.get(index)
    if name is None:
        import torch  # only once a GPU is asked about: the file format and its checks need no torch

        name = _NAMES[index] = torch.cuda.get_device_name(index)
    return name


def _shared_memory(index: int) -> Optional[int]:
    """The most shared memory a block may opt in to on GPU ``index``, or None where torch does not say."""
    import torch  # only for a GPU (see _gpu_name)

    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


def _load(index: int, target: str) -> Optional[Tuned]:
    """This GPU's entries: the shipped measured file's, overlaid by this machine's own file's."""
    gpu = _gpu_name(index)
    shipped = _load_file(MEASURED_DIR / file_name(gpu), index, gpu, target, shipped=True)
    own = _load_file(cache_path(gpu), index, gpu, target, shipped=False)
    if shipped is None or own is None:
        return own or shipped
    return own._replace(configs={**shipped.configs, **own.configs}, splits={**shipped.splits, **own.splits},
                        paths={**shipped.paths, **own.paths})


def _load_file(path: Path, index: int, gpu: str, target: str, shipped: bool) -> Optional[Tuned]:
    """One file's usable entries for GPU ``index``, or None; warns once for a file it ignores
    and for entries it drops."""
    what = "measured defaults shipped" if shipped else "tuned configurations"
    fix = ("The built-in table is used; a file of this machine's (`flash-recipe tune`) would take its place."
           if shipped else "The built-in table is used; run `flash-recipe tune` to tune again, or delete the file.")
    try:
        found = read(path)
        problem = key_problem(found.key, make_key(gpu, target), MEASURED_KEY_FIELDS if shipped else KEY_FIELDS)
    except FileNotFoundError:
        return None
    except BadCacheFile as exc:
        problem = str(exc)
    if problem is not None:
        _warn(path, f"flash_recipe ignores the {what} in {path}: {problem}. {fix}")
        return None
    found, dropped = fits(found, _shared_memory(index), gpu)
    if shipped:
        family, release = configs.arch_family(target), targets.triton_release()
        for (bucket, size), name in list(found.paths.items()):
            if name == "one_pass" and not configs.release_takes_one_pass(family, bucket, release):
                del found.paths[(bucket, size)]
                dropped.append(f"the one-pass backward at head dim {bucket}, {size}-byte elements, whose tile "
                               f"Triton {release[0]}.{release[1]} does not compile cleanly")
    if dropped:
        again = "" if shipped else "; run `flash-recipe tune` to tune again, or delete the file"
        entries = f"{len(dropped)} entr{'y' if len(dropped) == 1 else 'ies'}"
        _warn(path, f"flash_recipe ignores {entries} of the {what} in {path}: {'; '.join(dropped)}. "
                    f"The built-in table is used for them{again}.")
    return found


def _warn(path: Path, message: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        warnings.warn(message, TunedCacheWarning, stacklevel=3)


def for_device(device, target: str) -> Optional[Tuned]:
    """The tuned configurations for the CUDA/ROCm ``device`` (compile target ``target``), or None
    when there is no usable file. Read once per process and device."""
    if device.type != "cuda" or target == "interpreter":
        return None
    index = device.index
    if index is None:
        import torch  # only for a GPU (see _gpu_name)

        index = torch.cuda.current_device()
    memo = (index, target, os.environ.get(ENV_VAR), os.environ.get("XDG_CACHE_HOME"))
    try:
        return _LOADED[memo]
    except KeyError:
        pass
    with _LOCK:
        if memo not in _LOADED:
            _LOADED[memo] = _load(index, target)
            _changed()
        return _LOADED[memo]


def config_for(device, target: str, kernel: str, bucket: int, element_size: int) -> Optional[tuple]:
    """The tuned ``(block_m, block_n, num_warps, num_stages)`` for ``kernel`` at head-dim bucket
    ``bucket`` and ``element_size`` on ``device``, or None (use the table)."""
    tuned = for_device(device, target)
    if tuned is None or (target, kernel, bucket, element_size) in _REJECTED:
        return None
    return tuned.configs.get((kernel, bucket, element_size))


def splits_for(device, target: str, bucket: int, element_size: int, programs: int, capacity: int) -> Optional[int]:
    """The tuned split-KV count for a decoding step of ``programs`` query-block programs over a
    cache of ``capacity`` rows, or None (use the heuristic)."""
    tuned = for_device(device, target)
    if tuned is None:
        return None
    found = tuned.splits.get((bucket, element_size, power_of_two_at_least(programs), power_of_two_at_least(capacity)))
    return found or None  # 0: measured, and the heuristic was as fast


def path_for(device, target: str, bucket: int, element_size: int) -> Optional[str]:
    """The backward path measured fastest on ``device`` at head-dim bucket ``bucket`` and
    ``element_size`` (``"one_pass"`` or ``"three_kernels"``), or None (the family's default)."""
    tuned = for_device(device, target)
    if tuned is None:
        return None
    return tuned.paths.get((bucket, element_size))


# Counts the changes to what this module answers (entries read, forgotten or rejected): memoized
# launch plans are keyed by it (``choose.plan_state``).
GENERATION = [0]


def _changed() -> None:
    GENERATION[0] += 1


def forget() -> None:
    """Drop what this process read (and the warnings it gave, and the entries that failed to
    compile or launch): the next launch reads the files again."""
    with _LOCK:
        _LOADED.clear()
        _WARNED.clear()
        _NAMES.clear()
        _REJECTED.clear()
    _changed()


def reject(entries) -> None:
    """Serve these entries, ``(target, kernel, head-dim bucket, element size)``, from the table for
    the rest of the process: they failed to compile or launch (``choose.tuned_fallback``)."""
    with _LOCK:
        _REJECTED.update(entries)
    _changed()


# -- writing ----------------------------------------------------------------------------------


def config_entry(kernel: str, head_dim: int, element_size: int, config, **info) -> dict:
    """A ``configs`` entry; ``config`` is ``(block_m, block_n, num_warps, num_stages)``, ``info``
    informational fields (timings)."""
    block_m, block_n, num_warps, num_stages = config
    return {"kernel": kernel, "head_dim": head_dim, "element_size": element_size, "block_m": block_m,
            "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, **info}


def splits_entry(head_dim: int, element_size: int, programs: int, cache_len: int, num_splits: int, **info) -> dict:
    """A ``num_splits`` entry (0: keep the heuristic); ``programs`` and ``cache_len`` are rounded up to
    their buckets."""
    return {"head_dim": head_dim, "element_size": element_size, "programs": power_of_two_at_least(programs),
            "cache_len": power_of_two_at_least(cache_len), "num_splits": num_splits, **info}


def path_entry(head_dim: int, element_size: int, path: str, **info) -> dict:
    """A ``backward`` entry: the path, ``"one_pass"`` or ``"three_kernels"``, the GPU runs at
    ``head_dim``'s bucket and ``element_size``."""
    return {"head_dim": head_dim, "element_size": element_size, "path": path, **info}


def save(key: dict, configs: list, splits: list, directory: Optional[os.PathLike] = None, paths: list = ()) -> Path:
    """Write the entries (``configs``, ``num_splits``, and ``paths``, the ``backward`` section) to the
    cache file of ``key["gpu"]``; returns its path.

    Entries already in a usable file with the same key are kept unless an entry here has the same
    lookup key; a file that is unreadable or keyed otherwise is replaced. The file is written
    whole to a temporary name and renamed, so a reader never sees half of it; the read, merge and
    rename happen under ``locked``, so writers in other processes wait and merge in turn.
    """
    path = cache_path(key["gpu"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path):
        _merge_and_replace(path, key, configs, splits, list(paths))
    forget()
    return path


@contextlib.contextmanager
def locked(path: Path):
    """Hold an exclusive lock on ``<path>.lock`` (created 0600 if missing, never through a symlink)."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    handle = os.open(str(path) + ".lock", flags, 0o600)
    try:
        if os.name == "nt":
            import msvcrt  # each platform's lock module exists on that platform only

            msvcrt.locking(handle, msvcrt.LK_LOCK, 1)  # retries for 10 s, then raises OSError
        else:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def _merge_and_replace(path: Path, key: dict, configs: list, splits: list, paths: list) -> None:
    kept_configs, kept_splits, kept_paths = [], [], []
    try:
        old = read(path)
    except (FileNotFoundError, BadCacheFile):
        old = None
    if old is not None and key_problem(old.key, key) is None:
        new_configs = {(e["kernel"], e["head_dim"], e["element_size"]) for e in configs}
        new_splits = {(e["head_dim"], e["element_size"], e["programs"], e["cache_len"]) for e in splits}
        kept_configs = [e for e in old.document.get("configs", [])
                        if (e["kernel"], e["head_dim"], e["element_size"]) not in new_configs]
        kept_splits = [e for e in old.document.get("num_splits", [])
                       if (e["head_dim"], e["element_size"], e["programs"], e["cache_len"]) not in new_splits]
        new_paths = {(e["head_dim"], e["element_size"]) for e in paths}
        kept_paths = [e for e in old.document.get("backward", [])
                      if (e["head_dim"], e["element_size"]) not in new_paths]
    document = {"format": FORMAT, "key": dict(key), "configs": kept_configs + list(configs),
                "num_splits": kept_splits + list(splits), "backward": kept_paths + paths}
    parse(document)  # never write what the reader would refuse
    write_json(path, document)


def cache_files(directory: Optional[os.PathLike] = None) -> list:
    """The cache files in ``directory`` (default ``cache_dir()``), sorted."""
    directory = Path(directory if directory is not None else cache_dir())
    return sorted(directory.glob("*" + SUFFIX)) if directory.is_dir() else []
