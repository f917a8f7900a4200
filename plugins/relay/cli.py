"""The `relay` command."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from relay import settings
from relay.yamlsource import ConfigError

DEMO_SPEC = settings.jobs_dir() / "demo.yaml"


def _cmd_demo(args: argparse.Namespace) -> int:
    from relay import demo

    return demo.main(Path(args.spec), inject_fault=not args.no_faults)


def _cmd_spec_check(args: argparse.Namespace) -> int:
    from relay.spec import load_job_spec

    bad = 0
    for name in args.files:
        try:
            spec = load_job_spec(Path(name))
        except ConfigError as err:
            bad += 1
            print(err, file=sys.stderr)
            continue
        print(f"{name}: OK (DAG {spec.dag_id}, {len(spec.segments)} segments, "
              f"world size {spec.world_size})")
    return 1 if bad else 0


def _cmd_lineage(args: argparse.Namespace) -> int:
    from relay.demo import summarize

    return summarize(args.job, f"relay_{args.job}", since=0.0)


def _cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    from relay.bench.checkpoint import main as bench_main

    return bench_main(checkpoints=args.checkpoints, d_model=args.d_model, n_layers=args.n_layers)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of `relay`."""
    parser = argparse.ArgumentParser(prog="relay", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the demo job end to end through Airflow")
    demo.add_argument("--spec", default=str(DEMO_SPEC), help="job spec (default: %(default)s)")
    demo.add_argument("--no-faults", action="store_true", help="do not inject the demo's crash")
    demo.set_defaults(func=_cmd_demo)

    spec = sub.add_parser("spec", help="job specs").add_subparsers(dest="spec_cmd", required=True)
    check = spec.add_parser("check", help="validate job spec files")
    check.add_argument("files", nargs="+")
    check.set_defaults(func=_cmd_spec_check)

    lineage = sub.add_parser("lineage", help="print the newest DAG run's checkpoint chain")
    lineage.add_argument("job")
    lineage.set_defaults(func=_cmd_lineage)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    ckpt = bench.add_parser("checkpoint", help="loop stall per checkpoint, async vs sync")
    ckpt.add_argument("--checkpoints", type=int, default=8)
    ckpt.add_argument("--d-model", type=int, default=384)
    ckpt.add_argument("--n-layers", type=int, default=6)
    ckpt.set_defaults(func=_cmd_bench_checkpoint)
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
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
