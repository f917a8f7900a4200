"""`relay bench ...`: the benchmarks' command lines (the benchmarks: :mod:`relay.tools.bench`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _cmd_bench_checkpoint(args: argparse.Namespace) -> int:
    from relay.tools.bench.checkpoint_cost import main as bench_main

    return bench_main(checkpoints=args.checkpoints, d_model=args.d_model, n_layers=args.n_layers,
                      steps_between=args.steps_between, smoke=args.smoke)


def _cmd_bench_detect(args: argparse.Namespace) -> int:
    if args.load:
        from relay.tools.bench.detect_load import main as load_main

        return load_main(minutes=0.5 if args.smoke else args.minutes,
                         repeats=1 if args.smoke else args.repeats, only=args.only,
                         policy=args.policy)
    from relay.tools.bench.detect import main as bench_main

    return bench_main(repeats=1 if args.smoke else args.repeats, only=args.only,
                      startup_timeout=args.startup_timeout, policy=args.policy)


def _cmd_bench_overhead(args: argparse.Namespace) -> int:
    from relay.tools.bench.overhead import main as bench_main

    return bench_main(rounds=args.rounds, steps=args.steps, smoke=args.smoke)


def _cmd_bench_goodput(args: argparse.Namespace) -> int:
    from relay.tools.bench.goodput import main as bench_main

    return bench_main(steps=args.steps, segment=args.segment, every=args.every,
                      collective_timeout=args.collective_timeout, repeats=args.repeats,
                      smoke=args.smoke, measure_default_timeout=args.measure_default_timeout,
                      segment_boundary=args.segment_boundary, keep=args.keep)


def _cmd_bench_resume(args: argparse.Namespace) -> int:
    from relay.tools.bench.resume import main as bench_main

    return bench_main(runs=args.runs, steps=args.steps, every=args.every, keep=args.keep)


def _cmd_bench_scheduled(args: argparse.Namespace) -> int:
    from relay.tools.bench.scheduled import main as bench_main

    return bench_main(steps=args.steps, segment=args.segment, every=args.every,
                      repeats=args.repeats, smoke=args.smoke, timeout=args.timeout,
                      ettr=not args.no_ettr)


def _cmd_bench_watcher(args: argparse.Namespace) -> int:
    from relay.tools.bench.watcher import main as bench_main

    return bench_main(nodes=args.nodes, seconds=args.seconds, per_node=args.ranks_per_node,
                      smoke=args.smoke, direct=args.direct)


def _counts(text: str) -> list[int]:
    """Parse ``128,256`` into node counts."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected node counts such as 128,256, found {text!r}")
    return counts


def add_commands(sub: Any) -> None:  # noqa: ANN401 - argparse's private subparsers action
    """Add `relay bench` and its benchmarks to the `relay` parser's subcommands."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    ckpt = bench.add_parser("checkpoint", help="loop stall per checkpoint, async vs sync")
    ckpt.add_argument("--checkpoints", type=int, default=8)
    ckpt.add_argument("--d-model", type=int, default=384)
    ckpt.add_argument("--n-layers", type=int, default=6)
    ckpt.add_argument("--steps-between", type=int, default=10)
    ckpt.add_argument("--smoke", action="store_true", help="a tiny model, 2 saves: no figures")
    ckpt.set_defaults(func=_cmd_bench_checkpoint)
    detect = bench.add_parser("detect", help="latency from injected fault to watcher event")
    detect.add_argument("--repeats", type=int, default=5)
    detect.add_argument("--only", nargs="*", help="scenarios: hang rank node crash straggler "
                        "throughput nan launch")
    detect.add_argument("--startup-timeout", type=float, default=20.0)
    detect.add_argument("--policy", help="the policy whose detection thresholds to use "
                        "(default: the shipped policies/default.yaml)")
    detect.add_argument("--smoke", action="store_true",
                        help="1 trial per kind: checks it works, no figures")
    detect.add_argument("--load", action="store_true",
                        help="with the CPU oversubscribed 2x by busy processes: fault-free jobs "
                        "for --minutes (false alarms per hour), then each kind --repeats times "
                        "(precision, recall, detection p50/max)")
    detect.add_argument("--minutes", type=float, default=30.0,
                        help="with --load: minutes of fault-free jobs (default %(default)s)")
    detect.set_defaults(func=_cmd_bench_detect)
    overhead = bench.add_parser(
        "overhead", help="steps/s of Relay's loop vs the same loop with no Relay code")
    overhead.add_argument("--rounds", type=int, default=5)
    overhead.add_argument("--steps", type=int, default=300)
    overhead.add_argument("--smoke", action="store_true", help="1 round of 40 steps: no figures")
    overhead.set_defaults(func=_cmd_bench_overhead)
    watcher = bench.add_parser("watcher", help="watcher CPU and detection at many simulated nodes")
    watcher.add_argument("--nodes", type=_counts, default=[128, 256, 512, 1024],
                         help="node counts, comma-separated (default 128,256,512,1024)")
    watcher.add_argument("--ranks-per-node", type=int, default=8)
    watcher.add_argument("--smoke", action="store_true", help="8 nodes, 3 s fault-free")
    watcher.add_argument("--seconds", type=float, default=30.0)
    watcher.add_argument("--direct", action="store_true",
                         help="ask every agent directly, no aggregators (the design before)")
    watcher.set_defaults(func=_cmd_bench_watcher)
    goodput = bench.add_parser("goodput", help="ETTR under faults: Relay vs a torchrun baseline")
    goodput.add_argument("--steps", type=int, default=1200)
    goodput.add_argument("--segment", type=int, default=300)
    goodput.add_argument("--every", type=int, default=25)
    goodput.add_argument("--collective-timeout", type=float, default=120.0,
                         help="the baseline's short gloo timeout in seconds, as a careful team "
                         "would set it (default %(default)s); gloo's default 1800 s is derived "
                         "from it unless --measure-default-timeout")
    goodput.add_argument("--measure-default-timeout", action="store_true",
                         help="also run the baseline with gloo's default 1800 s timeout (slow)")
    goodput.add_argument("--repeats", type=int, default=3)
    goodput.add_argument("--smoke", action="store_true",
                         help="160 steps, 1 repeat, 15 s timeout: checks it works, no figures")
    goodput.add_argument("--segment-boundary", choices=["adopt", "restart"], default="adopt",
                         help="Relay's job spec segment_boundary (default %(default)s)")
    goodput.add_argument("--keep", type=Path, metavar="DIR",
                         help="run in this new folder and keep it (every attempt's logs), "
                         "instead of a temporary one")
    goodput.set_defaults(func=_cmd_bench_goodput)
    resume = bench.add_parser(
        "resume", help="fault -> first productive step per run for a stalled rank and a frozen "
        "node, Relay only, with the median per kind and per part")
    resume.add_argument("--runs", type=int, default=5)
    resume.add_argument("--steps", type=int, default=240)
    resume.add_argument("--every", type=int, default=20)
    resume.add_argument("--keep", type=Path, metavar="DIR",
                        help="run in this new folder and keep it (every attempt's logs)")
    resume.set_defaults(func=_cmd_bench_resume)
    scheduled = bench.add_parser(
        "scheduled", help="fault -> first productive step, and every run's ETTR, with the real "
        "scheduler and triggerer (the services of `make up`), goodput's job and fault schedule")
    scheduled.add_argument("--steps", type=int, default=1200)
    scheduled.add_argument("--segment", type=int, default=300)
    scheduled.add_argument("--every", type=int, default=25)
    scheduled.add_argument("--repeats", type=int, default=1)
    scheduled.add_argument("--timeout", type=float, default=1800.0,
                           help="seconds to wait for each DAG run (default %(default)s)")
    scheduled.add_argument("--smoke", action="store_true",
                           help="160 steps, 1 repeat: checks it works, no figures")
    scheduled.add_argument("--no-ettr", action="store_true",
                           help="only the faulty DAG run: no fault-free run, no torchrun "
                           "baseline, no ETTR")
    scheduled.set_defaults(func=_cmd_bench_scheduled)
