"""The targets, from the steps' results (pure functions): speed, memory, the tests' JUnit file and
verify's report."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Optional

from .plan import (
    DECODE_EAGER_RATIO,
    DECODE_LONG,
    DECODE_REPLAY_OF_COPY,
    DECODE_WIDE,
    LINEAR_SLACK,
    MEMORY_RATIO,
    REFERENCE,
    SPEED_TARGETS,
    SUBJECT,
)

# ----------------------------------------------------------------------------- summaries (pure)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def speed_targets(rows: list, shape_ids: list, subject: str = SUBJECT, reference: str = REFERENCE) -> list:
    """One entry per target mode and expected shape: both peers' TFLOP/s from ``rows`` (bench rows
    of one run), their ratio, and PASS when it reaches ``SPEED_TARGETS[mode]``. A shape either peer
    did not measure is a MISS with the reason."""
    by_key = {(row["shape"], row["peer"]): row for row in rows}
    targets = []
    for mode, required in SPEED_TARGETS.items():
        for shape_id in shape_ids:
            entry: dict[str, Any] = {"target": f"{mode} speed", "mode": mode, "shape": shape_id, "required": required}
            values: dict[str, Any] = {}
            notes = []
            for role, peer in (("subject", subject), ("reference", reference)):
                row = by_key.get((shape_id, peer))
                value = None if row is None else row.get(f"{mode}_tflops")
                if value is None:
                    why = "not measured" if row is None else row.get("error", f"no {mode} measurement")
                    notes.append(f"{peer}: {why}")
                values[role] = value
            entry.update(subject=values["subject"], reference=values["reference"], unit="TFLOP/s")
            if notes:
                entry.update(ratio=None, verdict="MISS", note="; ".join(notes))
            else:
                entry["ratio"] = values["subject"] / values["reference"]
                entry["verdict"] = _verdict(entry["ratio"] >= required)
            targets.append(entry)
    return targets


def decode_targets(rows: list, context: Optional[dict] = None) -> list:
    """Decoding targets from ``bench_decode`` rows (``--cuda-graph``: each step timed as Python calls
    it and replayed from a CUDA graph) and its ``context`` (the copy bandwidth measured in the run):

    - ``decode eager vs sdpa``: at batch >= ``DECODE_WIDE`` and caches of ``DECODE_LONG`` rows or
      more, flash_recipe's bandwidth called from Python over SDPA's, PASS at ``DECODE_EAGER_RATIO``;
    - ``decode replay vs sdpa``: every row, flash_recipe's replay over SDPA's own replay, PASS at 1;
    - ``decode replay of copy``: caches of ``DECODE_LONG`` rows or more, flash_recipe's replayed
      bandwidth over the device-to-device copy's, PASS at ``DECODE_REPLAY_OF_COPY[wide]`` (batch
      >= ``DECODE_WIDE``, or smaller).

    A row either side did not measure is a MISS that says why."""
    copy = (context or {}).get("copy_bytes_per_s")
    by_key = {(row["batch"], row["cache"], row["peer"]): row for row in rows}
    targets = []
    for batch, cache in sorted({(row["batch"], row["cache"]) for row in rows}):
        ours, sdpa = by_key.get((batch, cache, "flash_recipe"), {}), by_key.get((batch, cache, "sdpa"), {})
        shape = f"B{batch}-S{cache}"
        wide, long = batch >= DECODE_WIDE, cache >= DECODE_LONG
        if wide and long:
            targets.append(_ratio_target("decode eager vs sdpa", shape, ours, sdpa, "bytes_per_s", DECODE_EAGER_RATIO))
        targets.append(_ratio_target("decode replay vs sdpa", shape, ours, sdpa, "graph_bytes_per_s", 1.0))
        if long:
            required = DECODE_REPLAY_OF_COPY[wide]
            mine = ours.get("graph_bytes_per_s")
            entry: dict[str, Any] = {"target": "decode replay of copy", "shape": shape, "required": required}
            entry.update(unit="x", subject=_gbs(ours, "graph_bytes_per_s"), reference=copy / 1e9 if copy else None)
            if mine is None or not copy:
                why = ours.get("error") or ("no copy bandwidth measured" if not copy else "no CUDA-graph replay timed")
                entry.update(ratio=None, verdict="MISS", note=why)
            else:
                entry.update(ratio=mine / copy, verdict=_verdict(mine / copy >= required))
            targets.append(entry)
    return targets


def _ratio_target(name: str, shape: str, ours: dict, sdpa: dict, key: str, required: float) -> dict:
    """flash_recipe's ``key`` over SDPA's for one decoding row, PASS at ``required`` or more."""
    mine, theirs = _gbs(ours, key), _gbs(sdpa, key)
    entry: dict[str, Any] = {"target": name, "shape": shape, "required": required, "unit": "GB/s"}
    entry.update(subject=mine, reference=theirs)
    if mine is None or theirs is None:
        why = ours.get("error") or sdpa.get("error") or f"not measured ({key})"
        entry.update(ratio=None, verdict="MISS", note=why)
    else:
        entry.update(ratio=mine / theirs, verdict=_verdict(mine >= required * theirs))
    return entry


def _gbs(row: dict, key: str = "bytes_per_s"):
    return row[key] / 1e9 if key in row else None


def memory_targets(rows: list, subject: str = SUBJECT, reference: str = REFERENCE) -> list:
    """Peak-memory targets from memory rows: per (mode, causal, seqlen) the subject's peak over the
    reference's, PASS at most ``MEMORY_RATIO``; per (mode, causal) the subject's growth from the
    shortest to the longest sequence, PASS at most ``LINEAR_SLACK`` times the growth in length.
    The reference's own growth is given beside it."""
    peaks = {}
    for row in rows:
        if "error" not in row and "peak_mb" in row:
            peaks[(row["mode"], row["causal"], row["seqlen"], row["peer"])] = row["peak_mb"]
    errors = {
        (row.get("mode"), row["causal"], row["seqlen"], row["peer"]): row["error"] for row in rows if "error" in row
    }
    seqlens = sorted({row["seqlen"] for row in rows})
    groups = sorted({(row.get("mode"), row["causal"]) for row in rows if row.get("mode")}, key=str)
    targets = []

    def lookup(mode, causal, seqlen, peer):
        value = peaks.get((mode, causal, seqlen, peer))
        why = None if value is not None else errors.get((mode, causal, seqlen, peer), "not measured")
        return value, why

    for mode, causal in groups:
        mask = "causal" if causal else "full"
        for seqlen in seqlens:
            mine, why_mine = lookup(mode, causal, seqlen, subject)
            theirs, why_theirs = lookup(mode, causal, seqlen, reference)
            entry = {
                "target": f"{mode} peak memory",
                "mode": mode,
                "shape": f"S{seqlen}-{mask}",
                "subject": mine,
                "reference": theirs,
                "unit": "MiB",
                "required": MEMORY_RATIO,
            }
            if mine is None or theirs is None or theirs <= 0:
                notes = [f"{p}: {w}" for p, w in ((subject, why_mine), (reference, why_theirs)) if w]
                entry.update(ratio=None, verdict="MISS", note="; ".join(notes) or f"{reference} allocated nothing")
            else:
                entry.update(ratio=mine / theirs, verdict=_verdict(mine / theirs <= MEMORY_RATIO))
            targets.append(entry)
        if len(seqlens) >= 2:
            short, long = seqlens[0], seqlens[-1]
            allowed = LINEAR_SLACK * long / short
            growth = {}
            for peer in (subject, reference):
                a, b = peaks.get((mode, causal, short, peer)), peaks.get((mode, causal, long, peer))
                growth[peer] = b / a if a and b is not None else None
            entry = {
                "target": f"{mode} memory linear",
                "mode": mode,
                "shape": f"S{long}/S{short}-{mask}",
                "subject": growth[subject],
                "reference": growth[reference],
                "unit": "x",
                "required": allowed,
            }
            if growth[subject] is None:
                entry.update(ratio=None, verdict="MISS", note=f"{subject}: not measured at both lengths")
            else:
                entry.update(ratio=growth[subject], verdict=_verdict(growth[subject] <= allowed))
            targets.append(entry)
    return targets


def summarize_targets(targets: list) -> list:
    """One line per target kind (``fwd speed``, ``fwd_bwd peak memory``, ...): PASS when every
    shape passes, how many did, and the worst ratio (the least for speed, the most for memory)."""
    groups: dict = {}
    for t in targets:
        groups.setdefault(t["target"], []).append(t)
    summary = []
    for name, entries in groups.items():
        ratios = [t["ratio"] for t in entries if t.get("ratio") is not None]
        higher_is_better = name.endswith("speed") or name.startswith("decode")
        worst = (min(ratios) if higher_is_better else max(ratios)) if ratios else None
        passed = sum(t["verdict"] == "PASS" for t in entries)
        summary.append(
            {
                "target": name,
                "verdict": _verdict(passed == len(entries)),
                "passed": passed,
                "count": len(entries),
                "worst_ratio": worst,
                "required": entries[0].get("required"),
            }
        )
    return summary


def memory_table(rows: list) -> list:
    """Per (mode, causal, peer): peak MiB at each sequence length and the growth longest/shortest."""
    seqlens = sorted({row["seqlen"] for row in rows})
    table: dict = {}
    for row in rows:
        key = (row.get("mode"), row["causal"], row["peer"])
        entry = table.setdefault(key, {"mode": key[0], "causal": key[1], "peer": key[2], "peak_mb": {}, "total_mb": {}})
        entry["peak_mb"][row["seqlen"]] = row.get("peak_mb")
        entry["total_mb"][row["seqlen"]] = row.get("total_mb")
    for entry in table.values():
        a, b = entry["peak_mb"].get(seqlens[0]), entry["peak_mb"].get(seqlens[-1])
        entry["growth"] = b / a if len(seqlens) > 1 and a and b is not None else None
    return sorted(table.values(), key=lambda e: (str(e["mode"]), e["causal"], e["peer"]))


def parse_junit(path: Path) -> dict:
    """Counts and failures from a pytest JUnit XML file."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failures = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                problem = case.find(kind)
                if problem is not None:
                    message = (problem.get("message") or problem.text or "").strip().splitlines()
                    failures.append(
                        {
                            "test": f"{case.get('classname')}::{case.get('name')}",
                            "kind": kind,
                            "message": message[0][:200] if message else "",
                        }
                    )
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failures}


def summarize_verify(report: dict) -> dict:
    """The verify report's verdict, counts per dtype and kind, and the rows that failed."""
    counts: dict = {}
    for row in report.get("cases", []):
        kind = "kvcache" if row["case"].startswith("kv-") else "attention"
        key = f"{kind}/{row['dtype']}"
        done = counts.setdefault(key, {"checks": 0, "passed": 0})
        done["checks"] += 1
        done["passed"] += bool(row["passed"])
    return {
        "passed": report.get("passed"),
        "fingerprint": report.get("fingerprint"),
        "backends": report.get("backends"),
        "skipped": report.get("skipped"),
        "device": report.get("device"),
        "counts": counts,
        "mismatches": [row for row in report.get("cases", []) if not row["passed"]],
    }
