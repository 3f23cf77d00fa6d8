"""The asyncfeed command line.

asyncfeed bench measures asyncfeed against torch's DataLoader, torchdata.nodes and SPDL
on the built-in synthetic JPEG set (or --data DIR), prints a table per workload, and
writes a PNG (--plot) and, with --json, every raw figure; --markdown turns such a JSON
into the benchmarks page.

asyncfeed profile [DATA] runs a short pass of a data set through AsyncLoader and
DataLoader and says where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Sequence


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip() != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return vals


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _tail(args: argparse.Namespace) -> dict | None:
    """Workload e's TailModel fields from the flags (None: a fixed latency)."""
    p99, errors, stalls = args.p99, args.errors, args.stalls
    if args.tail:
        p99, errors, stalls = p99 or 0.25, errors or 0.1, stalls or 0.01
    if not (p99 or errors or stalls):
        return None
    return {"median": args.latency, "p99": p99, "error_rate": errors, "stall_rate": stalls,
            "stall_s": args.stall_s, "seed": args.seed}


def _names(choices: Sequence[str]):
    def parse(text: str) -> tuple[str, ...]:
        vals = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in vals if v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(choices)}")
        return vals
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncfeed", description="Keep GPUs fed: benchmark and profile data loading.",
        epilog="asyncfeed bench --help and asyncfeed profile --help list each command's "
               "options.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command")
    _bench_parser(sub)
    _profile_parser(sub)
    return p


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    """``asyncfeed bench`` and its options."""
    from .contenders import FAMILIES
    from .workloads import WORKLOADS
    b = sub.add_parser(
        "bench", help="benchmark asyncfeed against DataLoader, torchdata.nodes and SPDL",
        description="Run every contender on the same per-sample function (read, decode, "
                    "resize, crop) and report samples/s, CPU per sample, peak memory, time to "
                    "first batch and the tuning curve. Workloads: "
                    + "; ".join(f"{k}: {v}" for k, v in WORKLOADS.items()))
    b.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: tiny data, one round, few settings, "
                        "workload a only unless --workloads says otherwise; its ratios are "
                        "start-up costs, not a comparison")
    b.add_argument("--markdown", metavar="JSON",
                   help="run nothing: print the benchmarks page (docs/benchmarks.md) for the "
                        "results in JSON (written by --json)")
    b.add_argument("--data", metavar="DIR",
                   help="an ImageFolder tree (root/<class>/<image>) instead of the synthetic set")
    b.add_argument("--size", type=int, default=224, help="output side in pixels (224)")
    b.add_argument("--batch-size", type=int, default=None, help="batch size (32; 8 with --quick)")
    b.add_argument("--json", metavar="PATH", help="write every raw figure and the machine here")
    b.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG to write (default ./asyncfeed-bench.png; none with --quick)")
    b.add_argument("--no-plot", action="store_true", help="write no PNG")
    b.add_argument("--workloads", type=_names(tuple(WORKLOADS)), default=None,
                   help="comma-separated subset of " + ",".join(WORKLOADS) + " (default: all;"
                        " with --data, all but e: e would list the whole tree over HTTP; "
                        "with --quick, a)")
    b.add_argument("--cifar-samples", type=int, default=20_000,
                   help="size of workload f's CIFAR-like set, one epoch per run (20000)")
    b.add_argument("--ceiling-threads", type=_ints, default=(8, 16, 32, 64, 128, 256),
                   help="thread counts of the ceiling workload (8,16,32,64,128,256)")
    _remote_args(b)
    b.add_argument("--contenders", type=_names(tuple(FAMILIES)), default=tuple(FAMILIES),
                   help="comma-separated subset of " + ",".join(FAMILIES))
    b.add_argument("--repeats", type=int, default=None,
                   help="rounds of every configuration of (a), (b), (c), (f), (g), (h), the "
                        "ceiling and the overhead, interleaved A B A B; the others get "
                        "min(N, 2); "
                        "figures are medians (3; 1 with --quick)")
    b.add_argument("--samples", type=int, default=None,
                   help="samples per run in workload a (640); b, c, g and h scale from it")
    b.add_argument("--workers", type=_ints, default=None,
                   help="DataLoader num_workers sweep (default 0,1,2,4,... up to 2x cores)")
    b.add_argument("--threads", type=_ints, default=None,
                   help="thread sweep of the thread-based loaders (default 1,2,4,... to 2x cores)")
    b.add_argument("--images", type=int, default=None,
                   help="size of the synthetic set (1000; 64 with --quick)")
    b.add_argument("--cache", metavar="DIR",
                   help="where the synthetic set is generated (default $ASYNCFEED_CACHE or "
                        "~/.cache/asyncfeed)")
    b.add_argument("--ram-mb", type=float, default=None,
                   help="MB of Python objects the in-RAM data set holds (workload b; 192)")
    b.add_argument("--step-load", type=float, default=0.85,
                   help="simulated training step: consumes data at this fraction of the limit")
    b.add_argument("--interpolation", choices=("area", "linear"), default="area",
                   help="resize filter of the per-sample function (area)")
    b.add_argument("--device", default="auto",
                   help="cpu, cuda, or auto (cuda when available: pinned memory, H2D copy)")
    b.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a single run is killed and reported as failed")
    b.add_argument("--seed", type=int, default=0)


def _remote_args(b: argparse.ArgumentParser) -> None:
    """``asyncfeed bench``'s options for workload e (remote storage)."""
    b.add_argument("--latency", type=float, default=0.02,
                   help="seconds per HTTP request in workload e (0.02; the median with --p99)")
    b.add_argument("--p99", type=float, default=0.0,
                   help="workload e: the servers' latency is lognormal with this 99th "
                        "percentile (seconds; 0: fixed)")
    b.add_argument("--errors", type=float, default=0.0,
                   help="workload e: share of first attempts answered 503")
    b.add_argument("--stalls", type=float, default=0.0,
                   help="workload e: share of requests stalling --stall-s seconds")
    b.add_argument("--stall-s", type=float, default=2.0)
    b.add_argument("--tail", action="store_true",
                   help="workload e: the realistic server: --p99 0.25 --errors 0.1 --stalls 0.01")
    b.add_argument("--remote", type=_names(("http", "s3", "mount")), default=("http",),
                   help="workload e's storage: comma-separated http,s3 (moto behind a proxy),"
                        "mount (a FUSE passthrough of the folder; needs /dev/fuse) (http)")
    b.add_argument("--mount-ms", type=_floats, default=(2.0, 10.0),
                   help="workload e, mount: milliseconds per open and per first read (2,10)")
    b.add_argument("--train-samples", type=int, default=None,
                   help="samples per run in workload h (3 x --samples: long enough that the "
                        "defaults' first windows, which measure their executions, are not "
                        "most of the run)")
    b.add_argument("--remote-samples", type=int, default=None,
                   help="samples per run in workload e (2/5 of --samples)")

def _profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="where the loading time goes: stages, GIL share, bottleneck, advice",
        description="Run a short pass of DATA through AsyncLoader and through DataLoader "
                    "(num_workers = cores) and print side by side: samples/s, the stage "
                    "breakdown, the GIL share, the bottleneck and what to do about it "
                    "(docs/observability.md).")
    p.add_argument("data", nargs="?", default=None, metavar="DATA",
                   help="an ImageFolder tree (root/<class>/<image>), or module:factory "
                        "(a callable returning a data set); none: the synthetic JPEG set")
    p.add_argument("--synthetic", action="store_true",
                   help="use the built-in synthetic JPEG set (the default without DATA)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="seconds each loader runs after its first batch (10)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=224, help="ImageFolder output side (224)")
    p.add_argument("--images", type=int, default=512,
                   help="size of the synthetic set (512)")
    p.add_argument("--threads", type=int, default=None,
                   help="AsyncLoader num_threads (default: its own)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader num_workers (default: the cores)")
    p.add_argument("--no-dataloader", action="store_true", help="profile AsyncLoader only")
    p.add_argument("--execution", choices=("auto", "threads", "processes"), default="auto",
                   help="AsyncLoader's execution (auto)")
    p.add_argument("--model-ms", type=float, default=0.0,
                   help="a synthetic training step per batch, in ms (a sleep on the CPU, "
                        "a matmul loop on a GPU, where pynvml samples utilisation)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the raw figures as JSON to PATH (no PATH: to stdout, "
                        "instead of the table)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write a PNG of the stage breakdown over time")
    p.add_argument("--cache", metavar="DIR",
                   help="where the synthetic set is generated (default $ASYNCFEED_CACHE or "
                        "~/.cache/asyncfeed)")


def run_profile(args: argparse.Namespace) -> int:
    import json

    from . import profile as _profile
    if args.synthetic and args.data:
        print("asyncfeed profile: give DATA or --synthetic, not both", file=sys.stderr)
        return 2
    if args.seconds <= 0 or args.batch_size < 1:
        print("asyncfeed profile: --seconds and --batch-size must be positive",
              file=sys.stderr)
        return 2
    try:
        result = _profile.profile(
            args.data, seconds=args.seconds, batch_size=args.batch_size, size=args.size,
            images=args.images, threads=args.threads, workers=args.workers,
            model_ms=args.model_ms, dataloader=not args.no_dataloader, cache=args.cache,
            execution=args.execution)
    except (FileNotFoundError, ValueError, ImportError, AttributeError) as e:
        print(f"asyncfeed profile: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.plot:
        _profile.write_plot(result, args.plot)
    if args.json == "-":
        print(json.dumps(result, indent=1))
    else:
        print(_profile.render(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
            print(f"\nJSON: {os.path.abspath(args.json)}")
    if args.plot:
        print(f"plot: {os.path.abspath(args.plot)}", file=sys.stderr if args.json == "-"
              else sys.stdout)
    return 0


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _prepare_data(args: argparse.Namespace, images: int, samples: int, scratch: str) -> dict:
    """The folder the runs read (generated, or a listed subset of ``--data``), warmed."""
    from tqdm import tqdm

    from . import synthetic as _synthetic
    from .workloads import warm_page_cache, write_subset_listing
    t0 = time.time()
    if args.data:
        root = os.path.abspath(os.path.expanduser(args.data))
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no such directory: {root}")
        print(f"asyncfeed bench: listing {root} ...", file=sys.stderr)
        listing = os.path.join(scratch, "listing.json")
        info = {"root": root, "synthetic": False, "listing": listing,
                **write_subset_listing(root, samples, args.seed, listing)}
    else:
        parent = args.cache or _synthetic.cache_root()
        classes = min(10, images)
        if not _synthetic.is_complete(os.path.join(
                parent, _synthetic.dataset_name(images, classes, args.seed))):
            with tqdm(total=images, desc="generating synthetic JPEGs", unit="img",
                      file=sys.stderr, leave=False) as bar:
                root = _synthetic.ensure_synthetic(images, classes, seed=args.seed, root=parent,
                                                   progress=bar.update)
        else:
            root = _synthetic.ensure_synthetic(images, classes, seed=args.seed, root=parent)
        info = {"root": root, "synthetic": True, "listing": None, **_synthetic.summary(root)}
    info["prepare_s"] = time.time() - t0
    info["bytes_read_to_warm_page_cache"] = warm_page_cache(root, info["listing"])
    return info


def _workloads(args: argparse.Namespace) -> tuple[str, ...]:
    """``--workloads``; else ``a`` for a smoke run (every contender once, in seconds);
    else all (all but e with ``--data``: e would list the whole tree over HTTP)."""
    if args.workloads:
        return tuple(args.workloads)
    if args.quick:
        return ("a",)
    return (("a", "b", "c", "d", "f", "g", "h", "overhead", "ceiling") if args.data
            else ("a", "b", "c", "d", "e", "f", "g", "h", "overhead", "ceiling"))


def write_markdown(path: str) -> int:
    """Print the benchmarks page for the results JSON at ``path``."""
    import json

    from .markdown import markdown
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        print(f"asyncfeed bench: cannot read {path}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(results, path))
    return 0


def _plot_path(args: argparse.Namespace) -> str | None:
    """The PNG to write: ``--plot``, else ./asyncfeed-bench.png for a full run (a smoke
    run writes none unless asked: matplotlib's start would be a good part of it)."""
    if args.no_plot:
        return None
    return args.plot or (None if args.quick else "asyncfeed-bench.png")


def _missing_tools(args: argparse.Namespace) -> str | None:
    """Why the bench cannot run here (a package of the ``[bench]`` extra is missing), or None."""
    from .._optional import require
    needs = ["psutil", "tqdm"]
    if _plot_path(args):
        needs.append("matplotlib")
    if "e" in _workloads(args):
        needs += ["fsspec", "aiohttp"]  # workload e: an HTTP server and remote reads
    for mod in needs:
        try:
            require(mod, "asyncfeed bench", extra="bench")
        except ModuleNotFoundError as e:
            return str(e)
    return None


def bench(args: argparse.Namespace) -> int:
    import tempfile

    if args.markdown:
        return write_markdown(args.markdown)
    missing = _missing_tools(args)
    if missing:
        print(f"asyncfeed bench: {missing}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from . import report
    from .runner import Bench, default_threads, machine_info

    t_start = time.time()
    cores = _cores()
    quick = args.quick
    batch = args.batch_size or (8 if quick else 32)
    samples = args.samples or (4 * batch if quick else 640)
    images = args.images or (64 if quick else 1000)
    threads = args.threads or ((2,) if quick else default_threads(cores))
    if 0 in threads:
        print("asyncfeed bench: --threads must be >= 1", file=sys.stderr)
        return 2
    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="asyncfeed-bench-data-") as scratch:
        try:
            data = _prepare_data(args, images, samples, scratch)
        except FileNotFoundError as e:
            print(f"asyncfeed bench: {e}", file=sys.stderr)
            return 2
        settings = _settings(args, data, cores, batch, samples, threads, device)
        runner = Bench(settings)
        runner.plan()
        for fam, why in runner.skipped.items():
            print(f"asyncfeed bench: {fam}: {why}", file=sys.stderr)
        with tqdm(total=runner.n_runs(), desc="asyncfeed bench", unit="run", file=sys.stderr,
                  dynamic_ncols=True) as bar:
            runner.progress = bar
            runner.run()
    results = runner.results()
    results["machine"] = machine_info()
    results["data"] = data
    results["command"] = ["asyncfeed", "bench"] + list(args._argv)
    results["elapsed_s"] = time.time() - t_start
    results["memory_metric"] = "pss" if _has_pss() else "rss"
    print(report.render(results))
    if args.json:
        report.write_json(results, args.json)
        print(f"\nJSON: {os.path.abspath(args.json)}")
    plot = _plot_path(args)
    if plot:
        from .plot import write_png
        write_png(results, plot)
        print(f"plot: {os.path.abspath(plot)}")
    if quick:
        print("\n" + report.QUICK_NOTICE)
    failed = [c for rows in results["runs"].values() for c in rows
              for r in c["runs"] if not r.get("ok")]
    return 1 if failed else 0


def _settings(args: argparse.Namespace, data: dict, cores: int, batch: int, samples: int,
              threads: tuple[int, ...], device: str) -> Any:
    """The run's :class:`~.config.Settings` from the command line (``--quick``
    shrinks every set and sweep)."""
    from .runner import Settings, default_workers

    quick = args.quick
    return Settings(
        root=data["root"], synthetic=data["synthetic"], listing=data["listing"],
        size=args.size, batch_size=batch,
        workloads=_workloads(args),
        samples_remote=args.remote_samples or (samples if quick
                                               else max(batch, samples * 2 // 5)),
        latency=args.latency, tail=_tail(args), remotes=tuple(args.remote),
        mount_ms=tuple(args.mount_ms),
        families=tuple(args.contenders), repeats=args.repeats or (1 if quick else 3),
        samples=samples, samples_ram=samples if quick else max(batch, samples * 4 // 5),
        samples_gil=max(batch, samples // 2),
        workers=args.workers or ((0, 2) if quick else default_workers(cores)),
        threads=threads, cores=cores,
        ram_mb=args.ram_mb if args.ram_mb is not None else (8.0 if quick else 192.0),
        step_load=args.step_load, device=device, timeout=args.timeout, seed=args.seed,
        quick=quick, interpolation=args.interpolation,
        ttfb_workers=1 if quick else cores, sweep_asyncfeed=not quick,
        single_limit=not quick, retry_disturbed=not quick,
        samples_cifar=2048 if quick else args.cifar_samples,
        samples_pil=samples if quick else max(batch, samples // 2),
        samples_train=args.train_samples or (samples if quick else 3 * samples),
        samples_noop=2048 if quick else 20_000,
        ceiling_threads=(8, 32) if quick else args.ceiling_threads,
        ceiling_seconds=0.3 if quick else 1.0)


def _has_pss() -> bool:
    from .measure import has_pss
    return has_pss()


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While the command runs, ``kill`` (SIGTERM) ends it as Ctrl-C does: by an
    exception, so the run under way is killed and the fork server, servers and
    scratch folders are closed on the way out, where the default action would end
    the process on the spot and leave them.  The handler before is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    before = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        from .. import __version__
        print(__version__)
        return 0
    with _sigterm_exits():
        if args.command == "profile":
            return run_profile(args)
        if args.command != "bench":
            parser.print_help()
            return 2
        args._argv = argv[argv.index("bench") + 1:] if "bench" in argv else []
        return bench(args)


if __name__ == "__main__":
    sys.exit(main())
