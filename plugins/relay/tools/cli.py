"""The `relay` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.core import settings
from relay.core.exceptions import ConfigError, PoolStoreError
from relay.tools import cli_bench, cli_services, cli_testbed
from relay.tools.verify import FAULT_KINDS

DEMO_SPEC = settings.jobs_dir() / "demo.yaml"


def _cmd_demo(args: argparse.Namespace) -> int:
    from relay.tools import demo

    return demo.main(Path(args.spec), inject_fault=not args.no_faults, launcher=args.launcher)


def _cmd_verify(args: argparse.Namespace) -> int:
    import json

    from relay.tools import verify

    spec_file = verify.spec_path(args.job)
    if spec_file is None:
        print(f"relay verify: expected a job spec file or the name of a job in "
              f"{settings.jobs_dir()}; found {args.job!r}", file=sys.stderr)
        return 2
    fault = json.loads(args.chaos) if args.chaos else None
    return verify.main(spec_file, fault, kind=args.fault, rank=args.rank, step=args.step,
                       node=args.node)


def _for_each_file(
    files: list[str], load: Callable[[Path], Any], report: Callable[[str, Any], None]
) -> int:
    """Load each file; print every problem of the bad ones; return 1 if any was bad."""
    bad = 0
    for name in files:
        try:
            loaded = load(Path(name))
        except ConfigError as err:
            bad += 1
            print(err, file=sys.stderr)
            continue
        report(name, loaded)
    return 1 if bad else 0


def _cmd_spec_check(args: argparse.Namespace) -> int:
    from relay.spec.entry_check import import_problem
    from relay.spec.job import load_job_spec

    unimportable: list[str] = []

    def report(name: str, spec: Any) -> None:  # noqa: ANN401 - a JobSpec
        problem = None if args.no_imports else import_problem(spec, Path(name))
        if problem is not None:
            unimportable.append(name)
            print(problem, file=sys.stderr)
            return
        print(f"{name}: OK (DAG {spec.dag_id}, {len(spec.segments)} segments, "
              f"world size {spec.world_size})")

    code = _for_each_file(args.files, load_job_spec, report)
    return 1 if unimportable else code


def _cmd_spec_venv(args: argparse.Namespace) -> int:
    from relay.core.exceptions import RelayError
    from relay.tools.rank_venv import make_rank_venv

    folder = Path(args.folder).resolve()
    try:
        python = make_rank_venv(folder, with_pip=not args.without_pip)
    except RelayError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"made {folder}, layered on Relay's environment. In the job spec: "
          f"entrypoint: {{python: {folder}}}; add the script's packages with "
          f"{python} -m pip install ...")
    return 0


def _cmd_airflow(args: argparse.Namespace) -> int:
    import subprocess

    from relay.tools.airflow_env import airflow_bin, airflow_env, ensure_airflow_db

    env = airflow_env()
    ensure_airflow_db(env, settings.relay_home() / "logs" / "airflow-db.log")
    return subprocess.run([airflow_bin(), *args.airflow_args], env=env, check=False).returncode


def _cmd_lineage(args: argparse.Namespace) -> int:
    from relay.tools.demo import summarize

    return summarize(args.job, f"relay_{args.job}", since=0.0)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from relay.spec.yamlsource import parse_duration
    from relay.tools import doctor

    try:
        max_skew = parse_duration(args.max_skew)
    except ValueError as err:
        print(f"relay doctor --max-skew: {err}", file=sys.stderr)
        return 2
    return doctor.main(gpus=args.gpus, max_skew_seconds=max_skew)


def _cmd_chaos(args: argparse.Namespace) -> int:
    from relay.tools import chaos

    try:
        attempt = Path(args.attempt_dir) if args.attempt_dir else chaos.running_attempt(args.dag)
        if args.chaos_cmd == "stop-node":
            pgid = chaos.stop_node(attempt, args.node)
            print(f"stopped node {args.node} (process group {pgid}) in {attempt}")
        elif args.chaos_cmd == "continue-node":
            chaos.continue_node(attempt, args.node)
            print(f"continued node {args.node} in {attempt}")
        elif args.chaos_cmd == "kill-rank":
            pid = chaos.kill_rank(attempt, args.rank)
            print(f"killed rank {args.rank} (pid {pid}) in {attempt}")
        else:
            print(f"slowing rank {args.rank} {args.factor:g}x for {args.seconds:g}s in {attempt}")
            chaos.slow_rank(attempt, args.rank, args.factor, args.seconds)
    except (chaos.ChaosTargetError, OSError) as err:
        print(f"relay chaos: {err}", file=sys.stderr)
        return 2
    return 0


SCHEMA_FILE = settings.REPO_ROOT / "policies" / "schema.json"


def policy_schema_text() -> str:
    """Return the policy JSON Schema as written to policies/schema.json."""
    import json

    from relay.policy.model import Policy

    schema = Policy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Relay recovery policy"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _cmd_policy(args: argparse.Namespace) -> int:
    from relay.policy.model import load_policy

    if args.policy_cmd == "schema":
        text = policy_schema_text()
        if args.write:
            SCHEMA_FILE.write_text(text)
            print(f"wrote {SCHEMA_FILE}")
        else:
            print(text, end="")
        return 0
    job_text = ""
    if getattr(args, "job", None):
        from relay.policy.explain import explain_job
        from relay.spec.job import load_job_spec

        try:
            spec = load_job_spec(Path(args.job))
        except ConfigError as err:
            print(err, file=sys.stderr)
            return 1
        args.files = args.files or [str(spec.policy_path(Path(args.job)))]
        job_text = explain_job(spec)
    if not args.files:
        print("relay policy explain: expected policy files or --job SPEC, found neither",
              file=sys.stderr)
        return 2

    def report(name: str, loaded: Any) -> None:  # noqa: ANN401 - a LoadedPolicy
        if args.policy_cmd == "explain":
            from relay.policy.explain import explain
            print(explain(loaded) + (f"\n\n{job_text}" if job_text else ""))
        else:
            print(f"{name}: OK (sha256 {loaded.sha256})")

    return _for_each_file(args.files, load_policy, report)


def _cmd_policy_replay(args: argparse.Namespace) -> int:
    from relay.lineage.store import Lineage
    from relay.policy import replay
    from relay.policy.model import load_policy

    candidate = load_policy(Path(args.candidate))
    try:
        since = replay.parse_since(args.since)
        incidents = replay.load_incidents(Lineage.from_settings(), args.job, since)
    except replay.ReplayError as err:
        print(f"relay policy replay: {err}", file=sys.stderr)
        return 2
    if not incidents:
        print(f"No recorded faults for job {args.job}" + (f" since {args.since}" if args.since
                                                         else "") + ": nothing to replay.")
        return 0
    rows = replay.replay(incidents, candidate.policy, candidate.sha256)
    print(replay.format_report(rows, candidate, args.job))
    return 0


def _cmd_nodes(args: argparse.Namespace) -> int:
    import time

    from relay.nodes.pool import NodePool
    from relay.spec.yamlsource import parse_duration

    pool = NodePool()
    if args.nodes_cmd == "list":
        held, leases = pool.quarantines(), pool.leases()
        for node in pool.nodes:
            q = held.get(node)
            state = "healthy" if q is None else (
                f"quarantined until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(q.until))}"
                f" - {q.reason} (by {q.by})")
            if node in leases:
                state += f"; in use by {leases[node]['holder']}"
            print(f"{node:10} {state}")
        return 0
    if args.node not in pool.nodes:
        print(f"relay nodes: node {args.node!r}: expected one of {pool.nodes}", file=sys.stderr)
        return 2
    if args.nodes_cmd == "quarantine":
        try:
            seconds = parse_duration(args.duration)
        except ValueError as err:
            print(f"relay nodes quarantine --for: {err}", file=sys.stderr)
            return 2
        q = pool.quarantine(args.node, seconds, args.reason, by="relay nodes quarantine (by hand)")
        print(f"{args.node} quarantined until {time.ctime(q.until)}")
    else:
        released = pool.release(args.node)
        print(f"{args.node} released" if released else f"{args.node} was not quarantined")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of `relay`."""
    parser = argparse.ArgumentParser(prog="relay", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the demo job end to end through Airflow")
    demo.add_argument("--spec", default=str(DEMO_SPEC), help="job spec (default: %(default)s)")
    demo.add_argument("--no-faults", action="store_true", help="do not inject the demo's crash")
    demo.add_argument("--launcher", choices=["local", "slurm"], default="local",
                      help="local: simulated nodes on this machine; slurm: the Slurm test bed "
                      "(root; the bed `relay testbed up --nodes 5` made, else its own)")
    demo.set_defaults(func=_cmd_demo)

    verify_cmd = sub.add_parser(
        "verify", help="run a job without and with an injected fault; bit-exact or the first "
        "differing tensor")
    verify_cmd.add_argument("job", help="a job spec file, or a job's name in the jobs folder")
    verify_cmd.add_argument("--fault", default="hang", choices=FAULT_KINDS,
                            help="the fault to inject (default: %(default)s of the last rank "
                            "half-way through the middle segment)")
    verify_cmd.add_argument("--rank", type=int, help="the rank it strikes (default: the last)")
    verify_cmd.add_argument("--step", type=int, help="the step it strikes at")
    verify_cmd.add_argument("--node", help="the node it strikes (stop_node)")
    verify_cmd.add_argument("--chaos", help="the fault as run-conf JSON instead, e.g. "
                            "'{\"kind\": \"crash\", \"segment\": 1, \"step\": 75, \"rank\": 1}'")
    verify_cmd.set_defaults(func=_cmd_verify)

    spec = sub.add_parser("spec", help="job specs").add_subparsers(dest="spec_cmd", required=True)
    check = spec.add_parser("check", help="validate job spec files")
    check.add_argument("files", nargs="+")
    check.add_argument("--no-imports", action="store_true",
                       help="skip importing the entrypoint's packages in the ranks' environment")
    check.set_defaults(func=_cmd_spec_check)
    venv = spec.add_parser("venv", help="make a venv for entrypoint.python, layered on "
                           "Relay's environment (torch, NumPy, MLflow)")
    venv.add_argument("folder", help="the new venv's folder")
    venv.add_argument("--without-pip", action="store_true", help="no pip of its own")
    venv.set_defaults(func=_cmd_spec_venv)

    policy = sub.add_parser("policy", help="recovery policies")
    policy_sub = policy.add_subparsers(dest="policy_cmd", required=True)
    for name, helptext in (("check", "validate policy files; every problem with file:line"),
                           ("explain", "say in plain sentences what a policy does")):
        cmd = policy_sub.add_parser(name, help=helptext)
        cmd.add_argument("files", nargs="+" if name == "check" else "*")
        if name == "explain":
            cmd.add_argument("--job", help="a job spec: explain its policy (unless files are "
                             "given) and how it picks its checkpoint interval")
        cmd.set_defaults(func=_cmd_policy)
    replay_cmd = policy_sub.add_parser(
        "replay", help="re-decide a job's recorded faults (from MLflow) under a candidate policy")
    replay_cmd.add_argument("candidate", help="the candidate policy file")
    replay_cmd.add_argument("--job", required=True, help="the job name (its spec's `job:`)")
    replay_cmd.add_argument("--since", help="only DAG runs started from this date, e.g. 2026-12-01")
    replay_cmd.set_defaults(func=_cmd_policy_replay)
    schema = policy_sub.add_parser("schema", help="print (or --write) policies/schema.json")
    schema.add_argument("--write", action="store_true")
    schema.set_defaults(func=_cmd_policy)

    nodes = sub.add_parser("nodes", help="the node pool")
    nodes_sub = nodes.add_subparsers(dest="nodes_cmd", required=True)
    nodes_sub.add_parser("list", help="every node and its quarantine").set_defaults(func=_cmd_nodes)
    quarantine = nodes_sub.add_parser("quarantine", help="keep a node out of every job")
    quarantine.add_argument("node")
    quarantine.add_argument("--for", dest="duration", default="1h", help="e.g. 30m (default 1h)")
    quarantine.add_argument("--reason", default="quarantined by hand")
    quarantine.set_defaults(func=_cmd_nodes)
    release = nodes_sub.add_parser("release", help="lift a node's quarantine")
    release.add_argument("node")
    release.set_defaults(func=_cmd_nodes)

    airflow = sub.add_parser(
        "airflow", help="run an `airflow` command against Relay's embedded Airflow "
        "(SQLite under $RELAY_HOME, this repo's dags/)")
    airflow.add_argument("airflow_args", nargs=argparse.REMAINDER)
    airflow.set_defaults(func=_cmd_airflow)

    lineage = sub.add_parser("lineage", help="print the newest DAG run's checkpoint chain")
    lineage.add_argument("job")
    lineage.set_defaults(func=_cmd_lineage)

    chaos = sub.add_parser("chaos", help="break a running segment from outside")
    chaos_sub = chaos.add_subparsers(dest="chaos_cmd", required=True)
    for name, helptext in (
        ("stop-node", "SIGSTOP every process of a node"),
        ("continue-node", "SIGCONT a stopped node"),
        ("kill-rank", "SIGKILL one rank"),
        ("slow-rank", "slow one rank by freezing it part of the time"),
    ):
        cmd = chaos_sub.add_parser(name, help=helptext)
        if name.endswith("node"):
            cmd.add_argument("node")
        else:
            cmd.add_argument("rank", type=int)
        if name == "slow-rank":
            cmd.add_argument("--factor", type=float, default=2.0)
            cmd.add_argument("--seconds", type=float, default=60.0)
        target = cmd.add_mutually_exclusive_group()
        target.add_argument("--dag", help="newest running attempt of this DAG (default: any)")
        target.add_argument("--attempt-dir", help="the attempt folder to act on")
        cmd.set_defaults(func=_cmd_chaos)

    doctor = sub.add_parser("doctor", help="check this machine: GPUs, NCCL, a 2-rank all-reduce, "
                            "clock skew, the rendezvous address; exit 1 if something is broken")
    doctor.add_argument("--gpus", type=int, default=0,
                        help="fail unless at least this many GPUs are usable (default 0)")
    doctor.add_argument("--max-skew", default="2s",
                        help="largest clock difference to the MLflow server / Airflow DB "
                        "(default %(default)s)")
    doctor.set_defaults(func=_cmd_doctor)

    cli_bench.add_commands(sub)
    cli_services.add_commands(sub)
    cli_testbed.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `relay`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except (ConfigError, PoolStoreError) as err:  # bad input, or the node pool's database
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
