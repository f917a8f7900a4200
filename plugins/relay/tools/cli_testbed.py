"""`relay testbed up|down|status` (= make cluster-up / cluster-down): namespace hosts + Slurm."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from relay.core import settings

POINTER = "testbed.json"  # in RELAY_HOME: names the up test bed's state file


def _pointer() -> Path:
    return settings.relay_home() / POINTER


def _cmd_up(args: argparse.Namespace) -> int:
    from relay.tools.testbed import TestBedError, hosts, slurm

    if _pointer().exists():
        print(f"A test bed is already up ({_pointer()}); `relay testbed down` first",
              file=sys.stderr)
        return 1
    began = time.monotonic()
    try:
        hide = [str(settings.relay_home())]  # the hosts cannot read Relay's disk
        if args.no_slurm:
            bed = hosts.up([f"node{i + 1}" for i in range(args.nodes)], hide=hide)
        else:
            bed = slurm.up(args.nodes, timeout=args.timeout, hide=hide)
    except TestBedError as err:
        print(f"cluster-up failed: {err}", file=sys.stderr)
        return 1
    _pointer().parent.mkdir(parents=True, exist_ok=True)
    _pointer().write_text(json.dumps({"state": str(bed.state)}))
    print(f"Test bed {bed.name} up in {time.monotonic() - began:.1f} s (state {bed.state})")
    _print(bed)
    if not args.no_slurm:
        exports = " ".join(f"{k}={v}" for k, v in slurm.slurm_env(bed).items())
        print(f"  Slurm clients: export {exports}")
    return 0


def _print(bed: Any) -> None:  # noqa: ANN401 - a TestBed; imported lazily (root-only tools)
    for host in bed.hosts.values():
        print(f"  {host.name:9} {host.address:13} pid {host.pid:>7}  RELAY_HOME {host.home}"
              f"  (run: nsenter -t {host.init} -n -u -m -p -- CMD)")


def load_bed(state_file: str | None = None) -> Any:  # noqa: ANN401 - a TestBed or None
    """Return the test bed `relay testbed up` made (or the one ``state_file`` records), if up."""
    from relay.tools.testbed.hosts import TestBed

    if state_file:
        return TestBed.load(Path(state_file))
    if not _pointer().exists():
        return None
    state = Path(json.loads(_pointer().read_text())["state"])
    if not state.exists():
        print(f"{_pointer()} names {state}, which is gone; removing the pointer", file=sys.stderr)
        _pointer().unlink()
        return None
    return TestBed.load(state)


def _cmd_down(args: argparse.Namespace) -> int:
    from relay.tools.testbed import TestBedError, hosts

    bed = load_bed(args.state)
    if bed is None:
        print("No test bed is up")
        return 0
    began = time.monotonic()
    try:
        removed = hosts.down(bed)
    except TestBedError as err:
        print(f"cluster-down failed: {err}", file=sys.stderr)
        return 1
    if not args.state:
        _pointer().unlink()
    print(f"Test bed {bed.name} down in {time.monotonic() - began:.1f} s: {', '.join(removed)}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    bed = load_bed()
    if bed is None:
        print("No test bed is up")
        return 1
    print(f"Test bed {bed.name} (state {bed.state})")
    _print(bed)
    return 0


def add_commands(sub: Any) -> None:  # noqa: ANN401 - argparse's private subparsers type
    """Add `testbed` to `relay`'s subcommands."""
    bed = sub.add_parser("testbed", help="namespace hosts on a private bridge, with Slurm "
                         "(root; = make cluster-up / cluster-down)")
    bed_sub = bed.add_subparsers(dest="testbed_cmd", required=True)
    up = bed_sub.add_parser("up", help="make the hosts, start Slurm, wait until every node is idle")
    up.add_argument("--nodes", type=int, default=3, help="node hosts (default 3)")
    up.add_argument("--no-slurm", action="store_true", help="hosts only")
    up.add_argument("--timeout", type=float, default=30.0, help="seconds for Slurm to come up")
    up.set_defaults(func=_cmd_up)
    down = bed_sub.add_parser("down", help="remove exactly what `up` made")
    down.add_argument("--state", help="a test bed's state.json (e.g. one a killed test left; "
                      "default: the one `up` made)")
    down.set_defaults(func=_cmd_down)
    bed_sub.add_parser("status", help="the recorded hosts").set_defaults(func=_cmd_status)
