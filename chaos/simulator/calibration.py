"""The simulator's costs of detection, recovery, restarts and checkpoints, and their sources.

Every figure is a field of `Calibration` with a comment saying where it comes from:
measured by this repository's benchmarks (docs/benchmarks.md), published, or an
assumption for GPU clusters, said as such. Two of them grow with the job: the control
plane's work after a change (`control_s`, a function of the nodes) and the creation of
the new plan's communicators (`regroup_s`, a function of the GPUs). Each is a
`ScaleCurve` through the (size, seconds) points of one table below,
`CONTROL_PLANE_POINTS` and `COMMUNICATOR_POINTS`, so that a new measurement is one more
row. Planning time is not here: the simulator runs the real planner at every event and
charges what it took. Transfers are charged at the hardware preset's inter-node
bandwidth (`planaria.templates.analytic`), checkpoints at `storage_bandwidth` per node.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

AXES = ("log2", "linear")


class Point(NamedTuple):
    """One row of a scale table: at `size` (nodes or GPUs) it took `seconds`; `source` says
    who measured or published it, and how."""

    size: float
    seconds: float
    source: str


CONTROL_PLANE_POINTS: tuple[Point, ...] = (
    Point(4, 0.75, "benchmarks/recovery.py, 4 CPU nodes: the survivors' statuses 0.725 s (0.3 s of "
                   "it the debounce that gathers simultaneous failures) + the rendezvous 0.022 s"),
    Point(8, 0.95, "benchmarks/control_plane_scale.py --nodes 8 256, 8 nodes x 8 simulated workers, a node "
                   "killed: detected 0.32 s, every worker holding its record 1.28 s, less the planning "
                   "(0.01 s) that the simulator charges itself (docs/benchmarks.md, 2026-11-28)"),
)
"""The control plane's work after a change is detected, besides planning, by nodes: from
the detection to every worker holding its next record, less the planning, in the scale
harness's "node killed" change ((records_held_s - detected_s) - (planned_s - statuses_s)).

Measured where the machine had room: 4 nodes (real workers) and 8 nodes x 8 (the
harness). Beyond, the harness's own times are its two cores', not the control plane's:
in the same run, 256 nodes x 8 gave 30.6 s while the harness's node processes used 77.6
CPU seconds in the 53 s from the fault to the first step, and etcd 8.7 (16x the 8-node
figure, for 32x the nodes) and the leader's controller 0.85 (21x). That figure would
charge Planaria the harness's saturation, and is not a point here. Beyond 8 nodes the
curve goes on along the 4-to-8 slope, 0.2 s per doubling of the nodes (1.55 s at 64,
2.35 s at 1,024): what a change asks of the control plane per node is constant
(docs/benchmarks.md: 3 reads and 4 watch messages per node at a death, at 8 and at 256
nodes), done by all nodes at once, and what grows with N is etcd serving them and the
controller gathering N statuses, whose CPU grows about linearly (above). That growth is
assumed, not measured; a row measured at scale with room is where it stops being.

At 1,024 nodes x 8 (docs/benchmarks.md, "1,024 nodes x 8 measured", 2026-11-29) the
harness's wall clock was again its own (139 s to every worker bootstrapped, its node
processes using 283 of the 338 CPU seconds the two cores had), while what the curve
stands for was measured in CPU: etcd's three members 10.1 CPU seconds for the change
(3.4 s each) and the leader's controller and planner 1.7 s, with etcd's requests per
node the 8-node ones. The curve's 2.35 s at 1,024 is of that order; it stays the
extrapolation."""

COMMUNICATOR_POINTS: tuple[Point, ...] = (
    Point(8, 2.46, "NCCL 2.22.3, one node of 8 H100s: NCCL's own 'Init timings' line, total 2.46 s "
                   "(bootstrap 1.60, topology 0.52, kernels 0.18, connections 0.12); NVIDIA/nccl "
                   "issue #534, comment of 2024-07-22"),
    Point(98_304, 100.0, "PyTorch tutorial 'Introduction to Libuv TCPStore Backend' (X. Wu, July "
                         "2024): at 96K (98,304) ranks the libuv TCPStore completed its initialization "
                         "in 100 seconds (the legacy backend timed out after 30 minutes)"),
)
"""Creating one NCCL communicator across the new plan's W GPUs, by GPUs.

Every epoch of Planaria starts a new world group on a TCPStore its rank 0 hosts (its
groups are not split from a parent communicator: torch uses `ncclCommSplit` only when
a device is bound at `init_process_group`), so a change costs what a job's start does:
every rank connects to the store, then NCCL's bootstrap and topology search run. The
98,304-GPU point is the store's connection alone, a lower bound there: NCCL's own init
comes on top of it (Meta's NVIDIA/nccl PR #1789, July 2025: their fix saved 26 s of
CPU in `ncclBuildRing` at 96K ranks and 11 s in `initTransportsRank` at 48K, of what
takes "often several dozens of seconds at 100K scale").

Between the points the curve is linear in W (`axis="linear"`): what grows with W is
serial work per rank at one place, rank 0's store accepting every rank's connection
and NCCL's bootstrap ring of W - 1 steps (NVIDIA/nccl PR #1791). A curve linear in
log2(W) through the same two points would charge 24 s at 64 GPUs, which nothing
published supports. Below 8 GPUs it is flat at 2.46 s.

Looked for and not used: "2.5-minute init time at large scale (e.g. above certain K
GPUs)" on NCCL's default path (a PyTorch developer in NVIDIA/nccl issue #1156, January
2024, before the libuv store and NCCL 2.23) gives no size; NCCL 2.23's
`ncclCommInitRankScalable` ("spreads the load onto multiple bootstrap roots, allowing
for constant bootstrap time", NCCL 2.23.4's release commit) comes with no figure in
what was found; Meta's NCCLX paper ("Collective Communication for 100k+ GPUs", arXiv:2510.20171,
2025) is quoted by third-party summaries at about 265 s of NCCL initialization at 96K
GPUs, but its own text was not found; TrainMover (arXiv:2412.12636) reports about 20 s
of downtime per interruption at 1,024 GPUs for its whole recovery, no communicator
figure apart; in the Llama 3 paper and NVIDIA's resiliency extension no init figure
was found. The epoch's smaller groups (pipeline, tensor-parallel, gradient buckets) are
created at their first collective and are not charged: kind to Planaria, like the
lower bound at 96K."""


@dataclass(frozen=True)
class ScaleCurve:
    """Seconds as a function of a job's size, through (size, seconds) points: piecewise
    linear in log2(size) or in size (`axis`), flat below the first point (the smallest
    size measured is the floor), and beyond the last point along the last segment's slope
    (flat when there is one point). Sizes rise and seconds never fall from one point to
    the next, so the curve never falls as the job grows: a measurement that dipped would
    be noise, and a model in which a larger job pays less would mislead."""

    points: tuple[tuple[float, float], ...]
    axis: str = "log2"
    per: str = "nodes"
    """What the size counts (nodes, GPUs): said in the JSON and in errors."""

    def __post_init__(self) -> None:
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        if not self.points:
            raise ValueError("a scale curve needs at least one (size, seconds) point")
        for size, seconds in self.points:
            if not (math.isfinite(size) and size > 0 and math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"{seconds:g} s at {size:g} {self.per}: sizes must be positive, "
                                 "seconds finite and >= 0")
        for (s0, t0), (s1, t1) in zip(self.points, self.points[1:]):
            if s1 <= s0 or t1 < t0:
                raise ValueError(f"points must rise in {self.per} and not fall in seconds: "
                                 f"({s0:g}, {t0:g}) then ({s1:g}, {t1:g})")

    @classmethod
    def of(cls, table: tuple[Point, ...], axis: str, per: str) -> "ScaleCurve":
        """The curve through a table's rows (their sources stay in the table)."""
        return cls(tuple((p.size, p.seconds) for p in table), axis=axis, per=per)

    def flat(self, seconds: float) -> "ScaleCurve":
        """The same kind of curve, `seconds` at every size (`--set regroup_s=2`)."""
        return replace(self, points=((1.0, seconds),))

    def parse(self, text: str) -> "ScaleCurve":
        """`2` (flat) or `SIZE:SECONDS,SIZE:SECONDS...` (points, on this curve's axis)."""
        try:
            pairs = [tuple(float(v) for v in item.split(":")) for item in text.split(",")]
        except ValueError:
            raise ValueError(f"{text!r} is neither a number nor SIZE:SECONDS,... points") from None
        if len(pairs) == 1 and len(pairs[0]) == 1:
            return self.flat(pairs[0][0])
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"{text!r}: each point is SIZE:SECONDS")
        return replace(self, points=tuple(pairs))

    def __call__(self, size: float) -> float:
        points = self.points
        if len(points) == 1 or size <= points[0][0]:
            return points[0][1]
        x = self._x(size)
        segment = next((i for i in range(1, len(points)) if size <= points[i][0]), len(points) - 1)
        (s0, t0), (s1, t1) = points[segment - 1], points[segment]
        return t0 + (t1 - t0) * (x - self._x(s0)) / (self._x(s1) - self._x(s0))

    def _x(self, size: float) -> float:
        return math.log2(size) if self.axis == "log2" else size

    def describe(self) -> float | dict:
        """For the JSON: a flat curve is its number, any other its points and axis."""
        if len(self.points) == 1:
            return self.points[0][1]
        return {"per": self.per, "axis": self.axis, "points": [list(p) for p in self.points]}


def control_plane_curve() -> ScaleCurve:
    """`control_s`'s default: by live nodes, straight lines in log2(nodes)."""
    return ScaleCurve.of(CONTROL_PLANE_POINTS, axis="log2", per="nodes")


def communicator_curve() -> ScaleCurve:
    """`regroup_s`'s default: by the new plan's GPUs, straight lines in GPUs."""
    return ScaleCurve.of(COMMUNICATOR_POINTS, axis="linear", per="GPUs")


@dataclass(frozen=True)
class Calibration:
    detection_s: float = 4.49
    """A node that vanishes is declared gone when its etcd lease expires: measured 4.49 s
    with the agents' default 5 s TTL (benchmarks/detection.py, docs/benchmarks.md). All
    policies pay it: torchrun's etcd rendezvous and Bamboo also learn of a lost node
    from a lease or a timeout, which is no shorter."""
    control_s: ScaleCurve | float = field(default_factory=control_plane_curve)
    """Planaria's control plane after detection, besides planning, for N live nodes: the
    debounce that gathers simultaneous failures (0.3 s), the survivors' statuses and
    publishing the epoch. 0.75 s measured on 4 nodes, flat beyond them until the scale
    harness measures more (`CONTROL_PLANE_POINTS`). A number sets it flat."""
    regroup_s: ScaleCurve | float = field(default_factory=communicator_curve)
    """New process groups for the new plan, for its W GPUs: one NCCL communicator across
    all of them, from published figures (`COMMUNICATOR_POINTS`): 2.46 s at 8 GPUs,
    100 s at 98,304, linear in W between. (0.02 s was measured for a few gloo processes
    on loopback.) A number sets it flat."""
    transfer_efficiency: float = 0.5
    """Fraction of the inter-node link speed that layer-state copies reach: the
    recovery benchmark moved 28.3 MiB at 540 MiB/s over loopback gloo, about half of
    the loopback socket's own speed measured by the cpu hardware preset."""
    restart_s: float = 60.0
    """Restart-the-world, besides loading the checkpoint: stop every worker, start
    new processes, import torch, build the model, create NCCL communicators, re-run
    the data loader's warm-up. Measured 7.56 s for four CPU processes of a tiny model
    (torchrun, benchmarks/recovery.py), most of it process start and imports; on GPU
    clusters each of these grows (CUDA context, NCCL across hundreds of ranks, model
    construction), and Oobleck's simulator charges 76 to 701 s. 60 s is assumed,
    kind to the restart policies."""
    storage_bandwidth: float = 2e9
    """Bytes/s each node writes a checkpoint shard to (and reads it from) shared
    storage: assumed, a parallel file system's per-client speed. Checkpoints are
    sharded: every node saves and loads only its own stages."""
    boot_s: float = 60.0
    """From a node's arrival in the trace to its worker asking to join: the instance
    boots, the agent starts, the worker imports torch, initialises CUDA and builds the
    model. Measured 4-5 s for a local node on the development machine (the chaos
    reports' detection of an add-node); assumed 60 s for a GPU instance from a warm
    image. A node preempted before then never joins. All policies wait for it."""
    bamboo_failover_s: float = 1.0
    """Bamboo's switch to the redundant copy after detection (its predecessor already
    runs the lost stage's forward): assumed as short as Planaria's control plane."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ScaleCurve):
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"calibration {f.name} must be a finite number >= 0, got {value!r}")
            if f.default_factory is not dataclasses.MISSING:  # a scale curve given as a number: flat
                object.__setattr__(self, f.name, f.default_factory().flat(float(value)))
        if not 0 < self.transfer_efficiency <= 1:
            raise ValueError(f"calibration transfer_efficiency must be in (0, 1], got {self.transfer_efficiency}")
        if self.storage_bandwidth <= 0:
            raise ValueError("calibration storage_bandwidth must be positive")

    def with_overrides(self, pairs: list[str]) -> "Calibration":
        """`name=value` overrides, as `planaria simulate --set detection_s=10` gives them. A
        scale curve takes a number (flat: `regroup_s=2`) or its points
        (`control_s=4:0.75,64:1.1`, on the curve's own axis)."""
        known = {f.name for f in fields(self)}
        changes = {}
        for pair in pairs:
            name, sep, text = pair.partition("=")
            if not sep or name not in known:
                raise ValueError(f"--set {pair!r}: expected NAME=VALUE with NAME one of {sorted(known)}")
            current = getattr(self, name)
            try:
                changes[name] = current.parse(text) if isinstance(current, ScaleCurve) else float(text)
            except ValueError as err:
                raise ValueError(f"--set {pair!r}: {err}") from None
        return replace(self, **changes)

    def as_dict(self) -> dict:
        """Every figure, the scale curves as their points (for the JSON)."""
        return {f.name: (v.describe() if isinstance(v := getattr(self, f.name), ScaleCurve) else v)
                for f in fields(self)}


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (training time between checkpoints) that minimises the
    expected waste, by Daly's higher-order formula (Young's sqrt(2CM) to first order):
    sqrt(2CM)·(1 + sqrt(C/2M)/3 + C/(18M)) − C for C < 2M, else M. C is the checkpoint's
    cost, M the mean time between failures. (J. T. Daly, "A higher order estimate of the
    optimum checkpoint interval for restart dumps", FGCS 2006.)"""
    if mtbf_s <= 0:
        raise ValueError(f"the mean time between failures must be positive, got {mtbf_s}")
    if checkpoint_s <= 0:
        return math.inf if math.isinf(mtbf_s) else 0.0
    if math.isinf(mtbf_s):
        return math.inf
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s
