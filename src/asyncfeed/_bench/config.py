"""What a benchmark run is made of: its settings and the configurations it measures."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import contenders


#: the workloads every configuration of which runs ``Settings.repeats`` rounds; the
#: others run ``min(repeats, repeats_other)``
FULL_ROUNDS = ("a", "b", "c", "f", "g", "h", "ceiling", "overhead")


@dataclass
class Settings:
    """Everything a benchmark run depends on (recorded in the JSON)."""

    root: str
    synthetic: bool
    listing: str | None = None  # --data: the files used, listed once (see workloads)
    size: int = 224
    batch_size: int = 32
    workloads: tuple[str, ...] = ("a", "b", "c", "d", "e")
    families: tuple[str, ...] = tuple(contenders.FAMILIES)
    repeats: int = 3            # rounds for the workloads of FULL_ROUNDS
    repeats_other: int = 2      # at most this many for the others
    full_rounds: tuple[str, ...] = FULL_ROUNDS  # recorded: the report names them
    samples: int = 640          # per run, workload a
    samples_ram: int = 512      # workload b
    samples_gil: int = 320      # workload c
    workers: tuple[int, ...] = (0, 1, 2, 4)
    threads: tuple[int, ...] = (1, 2, 4)
    cores: int = 2
    ram_mb: float = 192.0       # Python objects held by workload b's data set
    samples_remote: int = 256   # workload e
    latency: float = 0.02       # workload e: seconds per HTTP request (the median with tail)
    tail: dict | None = None    # workload e: the servers' TailModel (p99, error_rate...)
    remotes: tuple[str, ...] = ("http",)  # workload e: http, s3, mount
    mount_ms: tuple[float, float] = (2.0, 10.0)  # workload e, mount: per open, per first read
    step_load: float = 0.85     # simulated step consumes data at this fraction of the limit
    device: str = "cpu"
    timeout: float = 300.0
    seed: int = 0
    quick: bool = False
    interpolation: str = "area"
    ttfb_workers: int = 2
    pss_interval: float = 1.0
    sweep_asyncfeed: bool = True  # False: asyncfeed only at its defaults (--quick)
    busy_threshold: float = 0.15  # a run during which others used more of the machine is
                                  # "disturbed": re-run once, left out of medians if possible
    retry_disturbed: bool = True
    single_limit: bool = True     # also the one-process limit (a, c)
    batch_size_small: int = 128   # workloads f and overhead (CIFAR-sized samples)
    samples_cifar: int = 20_000   # workload f: the set's size, one epoch per run
    samples_pil: int = 320        # workload g
    samples_train: int = 1920     # workload h
    samples_noop: int = 20_000    # workload overhead
    ceiling_threads: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    ceiling_seconds: float = 1.0  # workload ceiling: each run's length at the ideal rate


@dataclass
class Config:
    """One thing to measure: a contender (or the limit) on a workload, in one mode."""

    workload: str
    family: str                      # a contender family, or "limit"
    knob: int | None
    mode: str = "throughput"         # throughput | step | ttfb | limit
    context: str | None = None       # DataLoader start method
    dataset: str = "folder"          # folder | ram | gil | cifar | pil | sleep | noop
    role: str = "sweep"              # sweep | default | best | reference | limit
    runs: list[dict] = field(default_factory=list)

    @property
    def key(self) -> str:
        return (f"{self.workload}/{self.dataset}/{self.mode}/{self.family}/"
                f"{'default' if self.knob is None else self.knob}/{self.context or '-'}")

    @property
    def label(self) -> str:
        if self.family == "limit":
            return f"limit, {self.knob} proc{'s' if self.knob != 1 else ''} (no loader)"
        name = contenders.label(self.family, self.knob, self.context)
        return name + " (numpy rewrite)" if self.dataset == "gil-numpy" else name


def default_threads(cores: int) -> tuple[int, ...]:
    out = {1, 2, cores, 2 * cores}
    out.update(range(4, 2 * cores + 1, 4))
    return tuple(sorted(k for k in out if 1 <= k <= max(2, 2 * cores)))


def default_workers(cores: int) -> tuple[int, ...]:
    return (0,) + default_threads(cores)
