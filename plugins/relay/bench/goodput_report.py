"""What `relay bench goodput` prints: one table per repeat, then medians and spreads."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from relay.resume_time import PARTS

if TYPE_CHECKING:
    from relay.bench.goodput import Run


def sec_text(value: float | None, digits: int = 1) -> str:
    """Return seconds as ``2.0s``, or ``-`` for none."""
    return "-" if value is None else f"{value:.{digits}f}s"


def format_parts(parts: dict[str, float | None], digits: int = 1) -> str:
    """Return a time-to-resume breakdown as ``detect 2.0s, wake 0.1s, ...``."""
    return ", ".join(f"{p} {sec_text(s, digits)}" for p, s in parts.items())


def spread(values: list[float], unit: str = "s", digits: int = 1) -> str:
    """Return ``median [min-max] (n)`` or ``-``."""
    if not values:
        return "-"
    fmt = f"{{:.{digits}f}}{unit}"
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"


def ettr(run: Run, productive: float) -> float:
    """Return productive time / wall time (0 for a run that did not finish)."""
    return productive / run.wall if run.ok and run.wall > 0 else 0.0


def print_repeat(runs: list[Run], productive: float) -> None:
    """Print one repeat's runs."""
    print(f"    productive time: {productive:.1f}s (total steps x seconds per step of the two "
          "fault-free runs' training loops, pooled)")
    print(f"    {'run':24} {'ok':>3} {'wall':>8} {'ETTR':>5} {'tries':>5}  faults: kind "
          "(ended by; detected after; lost steps; fault -> first productive step)")
    for run in runs:
        detail = "; ".join(
            f"{f['kind']} ({f['ended_by']}; {sec_text(f['detected_after'])}; {f['lost_steps']}; "
            f"{sec_text(f['fault_to_resume'])})" for f in run.faults) or "-"
        print(f"    {run.name:24} {'yes' if run.ok else 'NO':>3} {run.wall:7.1f}s "
              f"{ettr(run, productive):5.2f} {run.attempts:>5}  {detail}")
        if run.note:
            print(f"    {'':24} {run.note}")
        for f in run.faults:
            if f.get("parts"):
                print(f"    {'':24} {f['kind']} time to resume: {format_parts(f['parts'])}")


def _by_name(all_runs: list[list[Run]]) -> dict[str, list[tuple[Run, int]]]:
    grouped: dict[str, list[tuple[Run, int]]] = {}
    for index, runs in enumerate(all_runs):
        for run in runs:
            grouped.setdefault(run.name, []).append((run, index))
    return grouped


def _faults_of(runs: list[tuple[Run, int]], key: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for run, _ in runs:
        for f in run.faults:
            if f.get(key) is not None:
                found.setdefault(f["kind"], []).append(float(f[key]))
    return found


def print_summary(all_runs: list[list[Run]], productive: list[float], short: float) -> None:
    """Print medians and spreads over the repeats, and Relay's time-to-resume breakdown."""
    print_ettr(all_runs, productive)
    print("\n  Fault -> first productive step, per kind (a fault a run never noticed has no "
          "row: it just ran slower):")
    for name, runs in _by_name(all_runs).items():
        for kind, values in _faults_of(runs, "fault_to_resume").items():
            detected = _faults_of(runs, "detected_after").get(kind, [])
            print(f"  {name:24} {kind:18} {spread(values):22} detected after "
                  f"{spread(detected)}")
    print_breakdown(all_runs)


def print_ettr(all_runs: list[list[Run]], productive: list[float]) -> None:
    """Print each run's wall time, ETTR and lost steps: median [min-max] over the repeats."""
    n = len(all_runs)
    print(f"\n  Over {n} repeat(s): median [min-max]. ETTR = productive time / wall time "
          "(absolute, every run).")
    print(f"  {'run':24} {'finished':>8}  {'wall':22} {'ETTR':22} lost steps per fault kind")
    for name, runs in _by_name(all_runs).items():
        walls = [r.wall for r, _ in runs]
        ettrs = [ettr(r, productive[i]) for r, i in runs]
        lost = "; ".join(f"{k} {'/'.join(str(int(v)) for v in vs)}"
                         for k, vs in _faults_of(runs, "lost_steps").items()) or "-"
        ok = sum(r.ok for r, _ in runs)
        print(f"  {name:24} {ok:>4}/{len(runs):<3}  {spread(walls):22} "
              f"{spread(ettrs, '', 2):22} {lost}")
        derived = [r.note for r, _ in runs if r.note.startswith("DERIVED")]
        if derived:
            print(f"  {'':24} {derived[0]} (per repeat; the timeout only ends a hang or frozen "
                  f"node later, all else equal)")


def print_breakdown(all_runs: list[list[Run]]) -> None:
    parts: dict[str, dict[str, list[float]]] = {}
    for runs in all_runs:
        for run in runs:
            for f in run.faults:
                for part, seconds in (f.get("parts") or {}).items():
                    if seconds is not None:
                        parts.setdefault(f["kind"], {}).setdefault(part, []).append(seconds)
    if not parts:
        return
    print("\n  Relay's time to resume, median seconds per part (decision.json `time_to_resume`):")
    print("  " + f"{'kind':18}" + "".join(f"{p[:10]:>11}" for p in PARTS))
    for kind, by_part in parts.items():
        cells = "".join(
            f"{statistics.median(by_part[p]):>10.2f}s" if p in by_part else f"{'-':>11}"
            for p in PARTS)
        print(f"  {kind:18}{cells}")

