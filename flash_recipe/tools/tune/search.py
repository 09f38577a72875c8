"""The search: each candidate checked, then timed against the table's configuration (``Tuner``),
and ``tune``, which runs it for every kernel, head dim and element size and saves the winners."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Optional

import torch

from ...ops import choose, configs, limits, targets, tuned
from ...ops.configs import Config
from .candidates import candidates, nearest, prune
from .problem import (
    BACKWARD,
    DTYPES,
    ELEMENT_SIZE,
    HEAD_DIMS,
    KERNEL_OF_PATH,
    KERNELS,
    SPLITS,
    Check,
    CheckSizes,
    Problem,
    Shape,
    Timer,
    Trial,
    TuneError,
    describe,
)

# -- timing -----------------------------------------------------------------------------------


def gpu_timer(warmup_ms: int = 25, rep_ms: int = 100) -> Timer:
    """The default timer: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs), median ms."""

    def timer(fn: Callable[[], Any], trial: Trial) -> float:
        from triton.testing import do_bench  # Triton on use: without it ``flash-recipe tune`` says why

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return timer


def timing_shapes(kernel: str, head_dim: int, seqlens, causal, tokens: int, nheads: int, decode_batches) -> list[Shape]:
    """fwd/bwd: each sequence length, batch ``max(1, tokens // seqlen)``, MHA, each of ``causal``;
    decode: one query row per batch entry of each ``decode_batches``, over a full cache of each
    length, with ``nheads // 4`` key heads when ``nheads`` is a multiple of 4 (else MHA)."""
    if kernel == "decode":
        nheads_k = nheads // 4 if nheads % 4 == 0 else nheads
        return [Shape(b, 1, s, nheads, nheads_k, head_dim, True) for s in seqlens for b in decode_batches]
    return [Shape(max(1, tokens // s), s, s, nheads, nheads, head_dim, c) for s in seqlens for c in causal]


def _programs_per_batch(timing, shape) -> int:
    """Programs per batch entry of a decoding step, as ``kvcache.auto_splits`` counts them (a GQA
    group packed into one program per kv head: ``kvcache.program_heads``)."""
    from ...ops import kvcache  # Triton on use: without it ``flash-recipe tune`` says why

    heads, rows = kvcache.program_heads(timing.q, shape.nheads_k)
    return heads * -(-rows // 16)


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _first_failure(checks: list, splits_options=(None,)) -> Optional[str]:
    """The first check the current launch configuration fails, over ``splits_options``, or None."""
    for check in checks:
        for splits in splits_options:
            problem = check.problem_with(splits)
            if problem is not None:
                return problem
    return None


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _row(kernel: str, head_dim: int, element_size: int, config, status: str, detail: str = "") -> dict:
    """One candidate's row of the report (``ms``: milliseconds per timing shape, filled when timed)."""
    return {
        "kernel": kernel,
        "head_dim": head_dim,
        "element_size": element_size,
        "config": list(config),
        "status": status,
        "detail": detail,
        "ms": {},
    }


@dataclasses.dataclass(frozen=True)
class Tuner:
    """One tuning run's settings (``tune``'s arguments of the same names, ``target`` the device's
    compile target) and where it reports (``progress``); its methods tune one kernel."""

    device: Any
    target: str
    timer: Timer
    grid: Optional[dict]
    prune: bool
    jobs: int
    check: CheckSizes
    causal: tuple
    seqlens: tuple
    tokens: int
    nheads: int
    decode_batches: tuple
    splits: tuple
    min_gain: float
    progress: Optional[Callable[[str], None]]
    max_candidates: Optional[int] = None

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def checks(self, kernel: str, head_dim: int, dtypes: list, causal: tuple) -> list[Check]:
        return [
            Check(Problem(kernel, dtype, shape, self.device, seed=i))
            for dtype in dtypes
            for i, shape in enumerate(self.check.shapes(kernel, head_dim, causal))
        ]

    def timed(self, kernel: str, head_dim: int, dtypes: list) -> list[Problem]:
        shapes = timing_shapes(
            kernel, head_dim, self.seqlens, self.causal, self.tokens, self.nheads, self.decode_batches
        )
        return [
            Problem(kernel, dtype, shape, self.device, seed=100 + i)
            for dtype in dtypes
            for i, shape in enumerate(shapes)
        ]

    def pruned(self, kernel: str, head_dim: int, dtype: str, found: list, table: Config) -> tuple[list, list]:
        """The candidates to check and time, and the compile rows (none without pruning)."""
        if not self.prune or self.target not in configs.SHARED_MEMORY_LIMIT:
            return found, []
        kept, rows = prune(kernel, head_dim, dtype, found, self.target, jobs=self.jobs)
        if table not in kept:
            kept.insert(0, table)  # the baseline: what runs untuned (the compile check covers it)
        return kept, rows

    def trial(self, kernel: str, head_dim: int, element_size: int, config: Config, checks: list, timed: list) -> dict:
        """Check ``config`` on ``checks`` and, when it computes the right thing, time it on each of
        ``timed``; one trial row, status ``ok``, ``wrong`` or ``error``."""
        row = _row(kernel, head_dim, element_size, config, "ok")
        splits_checked = (1, 3) if kernel == "decode" else (None,)  # one share, and uneven shares
        try:
            with choose.overriding(kernel, head_dim, element_size, config):
                problem = _first_failure(checks, splits_checked)
                if problem is not None:
                    return {**row, "status": "wrong", "detail": problem}
                for p in timed:
                    trial = Trial(kernel, p.dtype, p.shape, config, p.heuristic_splits)
                    row["ms"][f"{p.dtype} {p.shape.id}"] = float(self.timer(p.launch, trial))
        except Exception as exc:  # a launch that fails (out of resources, a compile error) rejects it
            return {**row, "status": "error", "detail": _failure(exc), "ms": {}}
        return row

    def best_config(self, kernel: str, head_dim: int, element_size: int, dtypes: list) -> dict:
        """Check and time every candidate for one (kernel, head-dim bucket, element size). Returns
        ``table``, ``winner`` (None when the table's configuration itself fails), ``speedup``,
        ``ms`` and ``table_ms`` (per timing shape), ``trials`` (one row per candidate) and
        ``pruned`` (the compile rows)."""
        if not configs.has_config(self.target, kernel, head_dim, element_size):  # the one launch, where not offered
            label = f"{kernel} d{head_dim} {'/'.join(dtypes)}"
            self.say(f"{label}: not offered on {self.target} (configs.ONE_LAUNCH_FAMILIES), not tuned")
            return dict(table=None, winner=None, speedup=1.0, ms={}, table_ms={}, trials=[], pruned=[])
        table = configs.get_config(self.target, kernel, head_dim, element_size)
        found = candidates(kernel, table, self.grid)
        kept, compile_rows = self.pruned(kernel, head_dim, dtypes[0], found, table)
        label = f"{kernel} d{head_dim} {'/'.join(dtypes)}"
        dropped = f", {len(found) - len(kept)} pruned by the compile for {self.target}" if compile_rows else ""
        fitting = kept
        kept = nearest(fitting, table, self.max_candidates)
        if len(kept) < len(fitting):
            dropped += f", {len(fitting) - len(kept)} beyond the {len(kept)} nearest the table's"
        self.say(f"{label}: {len(found)} candidates{dropped}, table {describe(table)}")
        checks, timed = self.checks(kernel, head_dim, dtypes, self.causal), self.timed(kernel, head_dim, dtypes)
        trials = [
            _row(
                kernel,
                head_dim,
                element_size,
                c,
                "pruned",
                next(r["problem"] for r in compile_rows if tuple(r["config"]) == c and not r["fits"]),
            )
            for c in found
            if c not in fitting
        ]
        trials += [
            _row(kernel, head_dim, element_size, c, "skipped", f"not among the {len(kept)} nearest the table's")
            for c in fitting
            if c not in kept
        ]
        results = {}
        for config in kept:
            trials.append(self.trial(kernel, head_dim, element_size, config, checks, timed))
            if trials[-1]["status"] == "ok":
                results[config] = trials[-1]["ms"]
            shown = (
                f"{_geomean(results[config].values()):.4g} ms (geomean)" if config in results else trials[-1]["detail"]
            )
            mark = "(table)" if config == table else ""
            self.say(f"  {describe(config):<16} {mark:<8} {trials[-1]['status']:<6} {shown}")
        outcome: dict[str, Any] = {"table": table, "winner": None, "trials": trials, "pruned": compile_rows}
        if table not in results:
            failure = next(t["detail"] for t in trials if tuple(t["config"]) == table)
            self.say(f"{label}: the table's configuration {describe(table)} failed ({failure}); nothing kept")
            return outcome
        ratios = {c: _geomean(ms[name] / results[table][name] for name in ms) for c, ms in results.items()}
        best = min(ratios, key=ratios.__getitem__)
        if ratios[best] > 1.0 - self.min_gain:
            best = table
        outcome.update(winner=best, speedup=1.0 / ratios[best], ms=results[best], table_ms=results[table])
        self.say(
            f"{label}: {describe(best)}{' (the table)' if best == table else ''}, "
            f"{1.0 / ratios[best]:.3f}x the table's speed"
        )
        return outcome

    def best_path(self, head_dim: int, element_size: int, dtypes: list) -> Optional[dict]:
        """Check, then time, the whole backward on each path with the configurations it launches
        now; one ``tuned.path_entry``: the other path where it beats the family's
        (``configs.BACKWARD_PATHS``) by ``min_gain``, else the family's; None when one fails. The
        one launch is timed where the target's table offers it (``configs.ONE_LAUNCH_FAMILIES``)."""
        label = f"backward path d{head_dim} {'/'.join(dtypes)}"
        default = configs.backward_path(self.target, configs.head_dim_bucket(head_dim))
        shapes = timing_shapes("bwd_onepass", head_dim, self.seqlens, self.causal, self.tokens, self.nheads, ())
        results = {}
        for path in limits.BACKWARD_PATH_NAMES:
            kernel = KERNEL_OF_PATH[path]
            if not configs.has_config(self.target, kernel, head_dim, element_size):
                continue  # the one launch, where the table does not offer it
            config = choose.launch_config(self.device, kernel, head_dim, element_size)
            checks = [
                Check(Problem(kernel, dtype, shape, self.device, seed=i, path=path))
                for dtype in dtypes
                for i, shape in enumerate(self.check.shapes(kernel, head_dim, self.causal))
            ]
            try:
                problem = _first_failure(checks)
                ms = {}
                if problem is None:
                    for i, shape in enumerate(shapes):
                        for dtype in dtypes:
                            timed = Problem(kernel, dtype, shape, self.device, seed=100 + i, path=path)
                            trial = Trial(kernel, dtype, shape, config, path=path)
                            ms[f"{dtype} {shape.id}"] = float(self.timer(timed.launch, trial))
            except Exception as exc:
                problem = _failure(exc)
            if problem is not None:
                self.say(f"{label}: {path} failed ({problem}); the family's path ({default}) stays")
                return None
            results[path] = ms
        ratios = {path: _geomean(ms[name] / results[default][name] for name in ms) for path, ms in results.items()}
        best = min(ratios, key=ratios.__getitem__)
        if ratios[best] > 1.0 - self.min_gain:
            best = default
        self.say(
            f"{label}: {best}{' (the family default)' if best == default else ''}, "
            f"{1.0 / ratios[best]:.3f}x the default's speed"
        )
        return tuned.path_entry(
            head_dim,
            element_size,
            best,
            default=default,
            speedup=round(1.0 / ratios[best], 4),
            ms={path: {k: round(v, 5) for k, v in ms.items()} for path, ms in results.items()},
        )

    def split_counts(self, head_dim: int, element_size: int, dtypes: list, decode_config: Config) -> list[dict]:
        """Check every split count with ``decode_config``, then time the useful ones per batch size
        and cache length; returns one ``tuned.splits_entry`` per bucket of programs and cache length
        (``num_splits`` 0 where none beats the heuristic by ``min_gain``)."""
        label = f"num_splits d{head_dim} {'/'.join(dtypes)}"
        checks = self.checks("decode", head_dim, dtypes, (True,))
        measured: dict = {}  # (programs bucket, cache bucket) -> [(heuristic, {splits: ms})]
        with choose.overriding("decode", head_dim, element_size, decode_config):
            usable = []
            for splits in self.splits:
                try:
                    problem = _first_failure(checks, (splits,))
                except Exception as exc:
                    problem = _failure(exc)
                if problem:
                    self.say(f"{label}: {splits} splits rejected: {problem}")
                else:
                    usable.append(splits)
            for timing in self.timed("decode", head_dim, dtypes):
                shape, heuristic = timing.shape, timing.heuristic_splits
                useful = -(-shape.seqlen_k // decode_config.block_n)  # more shares than key blocks only idle
                ms = {}
                for splits in sorted({s for s in usable if s <= useful} | {heuristic}):
                    try:
                        trial = Trial("decode", timing.dtype, shape, decode_config, splits)
                        ms[splits] = float(self.timer(lambda s=splits, t=timing: t.launch(s), trial))
                    except Exception as exc:
                        self.say(f"{label}: {splits} splits failed on {shape.id}: {_failure(exc)}")
                if heuristic in ms:
                    bucket = (
                        tuned.power_of_two_at_least(shape.batch * _programs_per_batch(timing, shape)),
                        tuned.power_of_two_at_least(shape.seqlen_k),
                    )
                    measured.setdefault(bucket, []).append((heuristic, ms))
        entries = []
        for (programs, cache_len), rows in sorted(measured.items()):
            common = set.intersection(*(set(ms) for _, ms in rows))  # measured on every shape of the bucket
            ratios = {s: _geomean(ms[s] / ms[h] for h, ms in rows) for s in common}
            heuristics = sorted({h for h, _ in rows})
            best = min(ratios, key=ratios.__getitem__) if ratios else 0
            gain = 1.0 / ratios[best] if ratios else 1.0
            if gain < 1.0 / (1.0 - self.min_gain):
                best, gain = 0, 1.0  # 0: the heuristic stays
            entries.append(
                tuned.splits_entry(
                    head_dim,
                    element_size,
                    programs,
                    cache_len,
                    best,
                    heuristic=heuristics,
                    speedup=round(gain, 4),
                    config=list(decode_config),
                    ms={str(s): [round(ms[s], 5) for _, ms in rows] for s in sorted(common)},
                )
            )
            chosen = f"{best} splits" if best else "the heuristic"
            self.say(
                f"{label}: {programs} programs, cache {cache_len}: {chosen} (heuristic "
                f"{'/'.join(map(str, heuristics))}), {gain:.3f}x the heuristic's speed"
            )
        return entries


def tune(
    kernels=KERNELS,
    head_dims=(64, 128),
    dtypes=("bfloat16",),
    seqlens=(1024, 4096),
    *,
    causal=(False, True),
    tokens: int = 16384,
    nheads: int = 16,
    decode_batches=(1, 8, 32),
    splits=SPLITS,
    device="cuda",
    timer: Optional[Timer] = None,
    grid: Optional[dict] = None,
    prune: bool = True,
    jobs: int = 1,
    check: CheckSizes = CheckSizes(),  # noqa: B008 (frozen: one shared default is safe)
    min_gain: float = 0.02,
    max_candidates: Optional[int] = None,
    save: bool = True,
    key: Optional[dict] = None,
    directory=None,
    progress: Optional[Callable[[str], None]] = None,
    seconds: Optional[float] = None,
    checkpoint: Optional[Callable[[dict], None]] = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict:
    """Tune the launch configurations (and decoding's split-KV count) on ``device``; write the winners.

    Args:
        kernels: of ``KERNELS``; ``"decode"`` also tunes ``num_splits`` (over ``splits``), and any
            backward kernel the backward's path (``Tuner.best_path``), after the kernels.
        head_dims: head-dim buckets (powers of two, 16 to 256).
        dtypes: of ``DTYPES``; fp16 and bf16 share their entries (element size 2).
        seqlens: sequence lengths of the fwd/bwd timing shapes, cache lengths of the decode ones.
        causal: the masks timed and checked (fwd/bwd).
        tokens, nheads, decode_batches: the timing shapes (``timing_shapes``).
        timer: ``timer(fn, trial) -> ms``; default ``gpu_timer()`` (a GPU only). Tests inject one.
        grid: ``{kernel: [Config, ...]}`` replacing ``GRID`` for those kernels (the table's
            configuration is always a candidate).
        prune: compile the candidates for the device's target first and drop those that do not
            fit (``prune()``; only for a GPU target with a limit on record), in ``jobs`` processes.
        check: the sizes every candidate's output is checked on.
        min_gain: a candidate must be this much faster (0.02: 2%) than the table's configuration
            (or the split heuristic) to replace it.
        max_candidates: time at most this many configurations per kernel that fit: the table's
            and those nearest it (``candidates.nearest``); None times every one.
        save: write the winners to the cache file of ``key`` (default: this GPU's, ``tuned.make_key``)
            in ``directory`` (default ``tuned.cache_dir()``).
        progress: called with one line of text per step.
        seconds: a bound on the run's wall-clock time (``clock``). The work goes in groups, one per
            head dim and element size in the order given: each kernel's configurations, the split
            counts, then the backward's path. A group starts only if the seconds used so far plus
            the longest group's fit in ``seconds``; the rest are listed in ``not_reached``.
        checkpoint: called with the report after each group, when the winners so far are saved:
            a run stopped from outside keeps what its finished groups measured.

    Returns:
        ``{"key", "path" (None unless saved), "configs" (the ``tuned.config_entry`` rows written),
        "num_splits" (the ``tuned.splits_entry`` rows), "backward" (the ``tuned.path_entry`` rows),
        "not_reached" (``{"head_dim", "dtypes"}`` per group ``seconds`` left out),
        "trials" (one row per candidate: kernel, head_dim, element_size, config, status
        ok/pruned/skipped (past ``max_candidates``)/wrong/error, detail, ms per timing shape),
        "pruned" (the compile rows)}``.

    Raises:
        TuneError: no GPU and no timer, a GPU without configuration tables, or nothing to key the
            cache by.
        ValueError: an argument outside its allowed values.
    """
    _check_arguments(kernels, head_dims, dtypes, seqlens, causal, decode_batches, splits, tokens, nheads, min_gain)
    device = torch.device(device)
    timer, target, key = _timer_target_key(device, timer, save, key)
    run = Tuner(
        device=device,
        target=target,
        timer=timer,
        grid=grid,
        prune=prune,
        jobs=jobs,
        check=check,
        causal=tuple(causal),
        seqlens=tuple(seqlens),
        tokens=tokens,
        nheads=nheads,
        decode_batches=tuple(decode_batches),
        splits=tuple(splits),
        min_gain=min_gain,
        progress=progress,
        max_candidates=max_candidates,
    )
    if prune and target not in configs.SHARED_MEMORY_LIMIT:
        run.say(
            f"no pruning: no shared-memory limit on record for {target} (a candidate that does not fit fails "
            f"at its launch and is rejected)"
        )
    groups: dict = {}  # element size -> dtypes
    for dtype in dtypes:
        groups.setdefault(ELEMENT_SIZE[dtype], []).append(dtype)
    report: dict[str, Any] = {
        "key": key,
        "path": None,
        "configs": [],
        "num_splits": [],
        "backward": [],
        "not_reached": [],
        "trials": [],
        "pruned": [],
    }
    # The GPU timed is the current device (``do_bench`` records its events there): ``device``'s.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    start, longest = clock(), 0.0
    for head_dim, (element_size, names) in itertools.product(head_dims, groups.items()):
        began = clock()
        if seconds is not None and began - start + longest > seconds:
            report["not_reached"].append({"head_dim": head_dim, "dtypes": names})
            run.say(
                f"head dim {head_dim} {'/'.join(names)}: not started, {began - start:.0f} s of {seconds:.0f} used "
                f"and a group took up to {longest:.0f} s"
            )
            continue
        _tune_configs(run, report, kernels, head_dim, element_size, names, bool(splits), on_device)
        if any(kernel in BACKWARD for kernel in kernels):
            _tune_path(run, report, head_dim, element_size, names, on_device)
        if save and (report["configs"] or report["num_splits"] or report["backward"]):
            report["path"] = str(
                tuned.save(key, report["configs"], report["num_splits"], directory, paths=report["backward"])
            )
            run.say(f"written: {report['path']}")
        if checkpoint is not None:
            checkpoint(report)
        longest = max(longest, clock() - began)
    return report


def _timer_target_key(device, timer: Optional[Timer], save: bool, key: Optional[dict]) -> tuple:
    """``(timer, target, key)`` of a run on ``device``: the GPU timer unless one is given, the
    device's compile target (which must have configuration tables), and the cache key (this GPU's
    unless given; None when nothing is saved)."""
    if timer is None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise TuneError(
                f"flash-recipe tune times the kernels on a GPU, and {device} is not one "
                f"(torch.cuda.is_available() is {torch.cuda.is_available()})"
            )
        timer = gpu_timer()
    target = targets.target_of(device)
    try:
        configs.arch_family(target)
    except ValueError as exc:
        raise TuneError(f"{target} has no configuration tables to tune: {exc}") from None
    if save and key is None:
        if device.type != "cuda" or target == "interpreter":
            raise TuneError("the cache is keyed by the GPU, and this run has none: pass key= or save=False")
        key = tuned.make_key(torch.cuda.get_device_name(device), target)
    return timer, target, key


def _tune_configs(
    run: Tuner, report: dict, kernels, head_dim: int, element_size: int, names: list, splits: bool, on_device
) -> None:
    """Each kernel's fastest configuration at ``head_dim`` and ``element_size`` (the dtypes ``names``)
    into ``report["configs"]`` (its trials and compile rows beside), and for ``decode`` with
    ``splits`` the split counts."""
    for kernel in kernels:
        with on_device:
            outcome = run.best_config(kernel, head_dim, element_size, names)
        report["trials"] += outcome["trials"]
        report["pruned"] += outcome["pruned"]
        if outcome["winner"] is not None:
            report["configs"].append(
                tuned.config_entry(
                    kernel,
                    head_dim,
                    element_size,
                    outcome["winner"],
                    table=list(outcome["table"]),
                    speedup=round(outcome["speedup"], 4),
                    dtypes=names,
                    ms={k: round(v, 5) for k, v in outcome["ms"].items()},
                    table_ms={k: round(v, 5) for k, v in outcome["table_ms"].items()},
                )
            )
        if kernel == "decode" and splits:
            decode_config = outcome["winner"] or choose.launch_config(run.device, "decode", head_dim, element_size)
            with on_device:
                report["num_splits"] += run.split_counts(head_dim, element_size, names, decode_config)


def _tune_path(run: Tuner, report: dict, head_dim: int, element_size: int, names: list, on_device) -> None:
    """The backward's fastest path at ``head_dim`` and ``element_size`` into ``report["backward"]``,
    each path running the configurations this run found fastest for its kernels."""
    winners = [
        (entry["kernel"], entry)
        for entry in report["configs"]
        if entry["head_dim"] == head_dim and entry["element_size"] == element_size and entry["kernel"] in BACKWARD
    ]
    with on_device, contextlib.ExitStack() as stack:
        for kernel, entry in winners:
            config = Config(entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"])
            stack.enter_context(choose.overriding(kernel, head_dim, element_size, config))
        found = run.best_path(head_dim, element_size, names)
    if found is not None:
        report["backward"].append(found)


def _check_arguments(kernels, head_dims, dtypes, seqlens, causal, decode_batches, splits, tokens, nheads, min_gain):
    def within(name, values, allowed):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(
                f"{name} must be a non-empty selection of {', '.join(map(str, allowed))}, got "
                f"{', '.join(map(str, values)) or 'nothing'}"
            )

    within("kernels", list(kernels), KERNELS)
    within("head_dims", list(head_dims), HEAD_DIMS)
    within("dtypes", list(dtypes), DTYPES)
    within("causal", list(causal), (False, True))
    for name, values, low in (("seqlens", seqlens, 1), ("decode_batches", decode_batches, 1)):
        if not values or any(not isinstance(v, int) or v < low for v in values):
            raise ValueError(f"{name} must be positive integers, got {list(values)}")
    if any(not isinstance(s, int) or not 1 <= s <= limits.MAX_SPLITS for s in splits):
        raise ValueError(f"splits must be integers from 1 to {limits.MAX_SPLITS}, got {list(splits)}")
    if tokens < 1 or nheads < 1:
        raise ValueError(f"tokens and nheads must be positive, got {tokens} and {nheads}")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
