"""What `relay bench goodput` prints: one table per repeat, then medians and spreads."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

from relay.lineage.resume_time import PARTS

if TYPE_CHECKING:
    from relay.tools.bench.goodput import Run

# Issue 12's goals under `airflow dags test` (figures of this machine, not test assertions).
GOAL_RESUME_SECONDS = 7.0  # fault -> first productive step, median per kind
GOAL_ETTR = 0.9  # absolute ETTR fault-free, and ETTR with faults relative to fault-free
FREE, FAULTY = "relay fault-free", "relay with faults"  # Relay's two runs of a repeat


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
    print_goals(all_runs, productive)


def relative_ettrs(all_runs: list[list[Run]]) -> list[float]:
    """Return, per repeat, the faulty run's ETTR relative to its own repeat's fault-free run:
    the same productive time, so fault-free wall / faulty wall (0 when either failed)."""
    found = []
    for runs in all_runs:
        by_name = {r.name: r for r in runs}
        free, faulty = by_name.get(FREE), by_name.get(FAULTY)
        if free is not None and faulty is not None:
            both = free.ok and faulty.ok and faulty.wall > 0
            found.append(free.wall / faulty.wall if both else 0.0)
    return found


def toward_goal(value: float, digits: int, at_least: bool) -> str:
    """Return ``value`` cut to ``digits`` decimals on the side away from its goal (down for a
    goal it must reach, up for a bound it must stay under), so a figure printed as meeting a
    goal does (rounding showed ETTR 0.895 as 0.90 beside "NOT met")."""
    scale = 10 ** digits
    cut = (math.floor(value * scale + 1e-9) if at_least else math.ceil(value * scale - 1e-9))
    return f"{cut / scale:.{digits}f}"


def verdict(values: list[float], meets: Callable[[float], bool]) -> str:
    """Say whether the median meets a goal, and in how many repeats each value did."""
    if not values:
        return "no figure"
    met = sum(meets(v) for v in values)
    return (f"{'met' if meets(statistics.median(values)) else 'NOT met'} by the median, "
            f"in {met} of {len(values)} repeat(s)")


def print_goals(all_runs: list[list[Run]], productive: list[float]) -> None:
    """Print Relay's figures against issue 12's goals, repeat by repeat."""
    print("\n  Against issue 12's goals (Relay's runs; each figure cut towards missing its goal:"
          " ETTR down to 3 decimals, seconds up to 1):")
    runs = _by_name(all_runs)
    for kind, values in _faults_of(runs.get(FAULTY, []), "fault_to_resume").items():
        print(f"  fault -> first productive step <= {GOAL_RESUME_SECONDS:g}s, {kind:18} "
              f"{' / '.join(toward_goal(v, 1, False) + 's' for v in values)}: "
              f"{verdict(values, lambda v: v <= GOAL_RESUME_SECONDS)}")
    free = [ettr(r, productive[i]) for r, i in runs.get(FREE, [])]
    print(f"  absolute ETTR fault-free >= {GOAL_ETTR:g}: "
          f"{' / '.join(toward_goal(v, 3, True) for v in free)}: "
          f"{verdict(free, lambda v: v >= GOAL_ETTR)}")
    relative = relative_ettrs(all_runs)
    print(f"  ETTR with faults relative to fault-free >= {GOAL_ETTR:g} (fault-free wall / "
          f"faulty wall, same repeat): {' / '.join(toward_goal(v, 3, True) for v in relative)}: "
          f"{verdict(relative, lambda v: v >= GOAL_ETTR)}")
    recorded = _faults_of(runs.get(FAULTY, []), "lost_steps")
    kinds = ("hang", "node_unresponsive", "straggler")
    lost = {k: [int(v) for v in recorded.get(k, [])] for k in kinds}
    every = all(len(lost[k]) == len(all_runs) for k in kinds)  # each fault, each repeat
    met = every and not any(v for k in kinds for v in lost[k])
    print(f"  lost steps 0 for a stalled rank, a frozen node and a straggler: "
          f"{'met' if met else 'NOT met'} ("
          + "; ".join(f"{k} {'/'.join(map(str, lost[k])) or 'no record'}" for k in kinds) + ")")


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

