"""`relay services up|down|status` and `relay report`: the deployment and its pictures."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from relay.core.exceptions import ServiceError


def _cmd_up(args: argparse.Namespace) -> int:
    from relay.tools import services

    began = time.monotonic()
    try:
        deployment = services.up(timeout=args.timeout)
    except ServiceError as err:
        print(f"make up failed: {err}", file=sys.stderr)
        return 1
    services.print_banner(deployment, time.monotonic() - began)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from relay.tools import services

    stopped = services.down()
    print(f"Stopped {len(stopped)} process(es)" if stopped else "Nothing was running")
    return 0


def _cmd_restart(args: argparse.Namespace) -> int:
    from relay.tools import services

    try:
        pid = services.restart(args.component)
    except ServiceError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{args.component} restarted: pid {pid}")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from relay.tools import services

    deployment = services.read_deployment()
    if deployment is None:
        print("Not running (no services.json)")
        return 1
    for name, pid in deployment.pids.items():
        print(f"  {name:14} pid {pid:>7}  {'up' if deployment.running(name) else 'DEAD'}")
    print(f"  Airflow {deployment.api_url}   MLflow {deployment.mlflow_url}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from relay.lineage.report_files import write_report

    try:
        written = write_report(args.job, args.run, Path(args.out), log_to_mlflow=args.log)
    except LookupError as err:
        print(err, file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def add_commands(sub: Any) -> None:  # noqa: ANN401 - argparse's private subparsers type
    """Add `services` and `report` to `relay`'s subcommands."""
    svc = sub.add_parser("services", help="a real Airflow + MLflow server on loopback "
                         "(= make up / make down)")
    svc_sub = svc.add_subparsers(dest="services_cmd", required=True)
    up = svc_sub.add_parser("up", help="start everything, wait until healthy, print URLs")
    up.add_argument("--timeout", type=float, default=240.0)
    up.set_defaults(func=_cmd_up)
    svc_sub.add_parser("down", help="stop exactly what `up` started").set_defaults(func=_cmd_down)
    svc_sub.add_parser("status", help="the recorded processes").set_defaults(func=_cmd_status)
    restart = svc_sub.add_parser("restart", help="stop what is left of one component and "
                                 "start it again (e.g. after it crashed)")
    restart.add_argument("component", choices=["mlflow", "api-server", "scheduler",
                                               "dag-processor", "triggerer"])
    restart.set_defaults(func=_cmd_restart)

    report = sub.add_parser("report", help="timeline and loss PNGs, the fault table (text, JSON)")
    report.add_argument("job")
    report.add_argument("--run", help="DAG run id (default: the newest run of the job)")
    report.add_argument("--out", required=True, help="folder to write into")
    report.add_argument("--log", action="store_true",
                        help="also log the PNGs to the DAG run's MLflow run")
    report.set_defaults(func=_cmd_report)
