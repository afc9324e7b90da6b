"""What the chaos harness injects, and when: `KIND@STEP[:target=T]`.

    kill-worker@6            SIGKILL one worker (the seed picks a live one)
    kill-node@3:target=2     SIGKILL node 2's agent and workers together (a machine vanishes)
    kill-agent@4             SIGKILL an agent only (its workers die with it)
    hang-worker@5:target=1.0 SIGSTOP worker 0 of node 1 (it neither dies nor answers)
    freeze-node@4:target=3   SIGSTOP node 3's agent and workers together (its lease lapses,
                             its sockets stay open and silent: a node cut off the network)
    isolate-node@4:target=3:for=20
                             with --hosts: node 3's packets to and from every other host
                             (etcd's included) vanish for 20 s, then the link is healed
    slow-link@4:target=1:for=30
                             with --hosts: node 1's link limited to 1 Mbit/s for 30 s
    partition@4:target=4+5:for=20
                             with --hosts: nodes 4 and 5 and the other nodes cannot reach
                             each other for 20 s; both sides still reach etcd
    isolate-etcd-member@6:target=0:for=15
                             with --hosts and --etcd-members 3: etcd member 0 cut off from
                             the other members (a minority that still answers connections)
    kill-etcd-member@7       SIGKILL one etcd member (with --etcd-members 3)
    preempt-node@8:target=2:notice=20
                             node 2's cloud announces its preemption 20 s ahead (its
                             instance metadata, as EC2 spot does: `planaria.chaos.cloud`;
                             with --hosts, which cannot reach it, its agent gets SIGTERM,
                             the scheduler's notice, with a 20 s --preemption-grace);
                             the node should leave at a step boundary; if it is still
                             there at the deadline, it is SIGKILLed
    add-node@9               start one more node
    kill-node@3+1.5          1.5 s after step 3 is reached (during the recovery of a
                             fault at step 3, say)

A fault at step S fires once the job has committed S steps, while step S runs; `+D`
delays it D seconds past that moment (the job may be recovering meanwhile). A target
is a node index as launched (`2`: node2) or a node and a local rank (`2.0`); without
one, the harness's seeded random generator picks a live node. Faults at the same step
fire together. Everything is checked before anything starts: `validate` names what is
wrong and what to write instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("kill-worker", "kill-node", "kill-agent", "hang-worker", "freeze-node", "kill-etcd-member", "add-node",
         "isolate-node", "slow-link", "partition", "isolate-etcd-member", "preempt-node")
WORKER_KINDS = ("kill-worker", "hang-worker")
ETCD_KINDS = ("kill-etcd-member", "isolate-etcd-member")
NETWORK_KINDS = ("isolate-node", "slow-link", "partition", "isolate-etcd-member")
"""Faults made on the links between simulated hosts: they need `--hosts`, and last `for=` seconds."""
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?:\+(?P<delay>\d+(?:\.\d*)?)s?)?"
                   r"(?::target=(?P<target>\d+(?:\.\d+|(?:\+\d+)+)?))?(?::for=(?P<duration>\d+(?:\.\d*)?)s?)?"
                   r"(?:[:,]notice=(?P<notice>\d+(?:\.\d*)?)s?)?$")


class FaultSpecError(ValueError):
    """A fault that cannot be injected; the message says why and what would do."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    step: int
    node: int | None = None
    """The node index as launched; None: the harness picks a live one."""
    local: int | None = None
    """The worker's local rank (worker kinds only); None: the harness picks."""
    delay_s: float = 0.0
    """Seconds past the moment step `step` was reached."""
    duration_s: float | None = None
    """How long a network fault lasts before it is healed (network kinds only)."""
    group: tuple[int, ...] = ()
    """A partition's side given as target=A+B+...: these nodes against the others."""
    notice_s: float | None = None
    """A preemption's notice: seconds from the announcement to the node's end."""

    def __str__(self) -> str:
        target = "" if self.node is None else f":target={self.node}" + (
            "" if self.local is None else f".{self.local}")
        if self.group:
            target = f":target={'+'.join(map(str, self.group))}"
        duration = "" if self.duration_s is None else f":for={self.duration_s:g}"
        notice = "" if self.notice_s is None else f":notice={self.notice_s:g}"
        return f"{self.kind}@{self.step}{f'+{self.delay_s:g}' if self.delay_s else ''}{target}{duration}{notice}"


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text.strip())
    if not match:
        raise FaultSpecError(f"bad fault {text!r}: expected KIND@STEP[+SECONDS][:target=NODE[.LOCAL]][:for=SECONDS]"
                             f"[:notice=SECONDS], "
                             f"such as kill-node@3, kill-node@3+1.5, kill-worker@6:target=2.0 or "
                             f"isolate-node@4:target=1:for=20")
    kind = match["kind"]
    if kind not in KINDS:
        raise FaultSpecError(f"unknown fault kind {kind!r} in {text!r}; known kinds: {', '.join(KINDS)}")
    node = local = None
    group: tuple[int, ...] = ()
    if match["target"] and "+" in match["target"]:
        if kind != "partition":
            raise FaultSpecError(f"{text!r}: only a partition takes a group of nodes (target=A+B); "
                                 f"{kind} takes one")
        group = tuple(sorted(set(int(n) for n in match["target"].split("+"))))
    elif match["target"]:
        node_text, _, local_text = match["target"].partition(".")
        node, local = int(node_text), (int(local_text) if local_text else None)
        if kind in (*ETCD_KINDS, "add-node") and local is not None:
            raise FaultSpecError(f"{text!r}: {kind} takes no worker target")
        if local is not None and kind not in WORKER_KINDS:
            raise FaultSpecError(f"{text!r}: {kind} acts on a whole node; give target={node}")
    duration = None if match["duration"] is None else float(match["duration"])
    if kind in NETWORK_KINDS and not duration:
        raise FaultSpecError(f"{text!r}: a network fault lasts a while; say how long with :for=SECONDS "
                             f"(such as {kind}@{match['step']}:for=20)")
    if kind not in NETWORK_KINDS and duration is not None:
        raise FaultSpecError(f"{text!r}: {kind} is not a network fault and takes no :for=")
    if kind == "partition" and node is not None:
        group = (node,)
        node = None
    notice = None if match["notice"] is None else float(match["notice"])
    if (kind == "preempt-node") != (notice is not None):
        raise FaultSpecError(f"{text!r}: " + ("a preemption comes with a notice; say how long with :notice=SECONDS "
                                              f"(such as preempt-node@{match['step']}:notice=20)"
                                              if notice is None else f"only preempt-node takes :notice=, not {kind}"))
    return FaultSpec(kind, int(match["step"]), node, local, float(match["delay"] or 0), duration, group, notice)


def preemption_grace(faults: list[FaultSpec]) -> float | None:
    """The notice of the run's first preemption, in seconds (None: none): with --hosts,
    every agent's --preemption-grace (their notice is the scheduler's signal; the
    simulated hosts cannot reach the local cloud's metadata)."""
    return next((f.notice_s for f in sorted(faults, key=lambda f: f.step) if f.kind == "preempt-node"), None)


def validate(faults: list[FaultSpec], *, steps: int, nodes: int, nproc: int, etcd_members: int,
             hosts: bool = False) -> None:
    """Refuse faults the job cannot meet: a step at or beyond `train.steps`, a target that
    does not exist (nodes added by add-node count, in order), an etcd member to kill with
    a single-member etcd, a network fault without simulated hosts."""
    launched = nodes
    for fault in sorted(faults, key=lambda f: f.step):
        if fault.kind == "preempt-node" and hosts and fault.notice_s != preemption_grace(faults):
            raise FaultSpecError(f"{fault}: with --hosts a preemption's notice is its agent's SIGTERM and "
                                 "--preemption-grace, one for every node; give every preempt-node the same "
                                 f"notice (the first says {preemption_grace(faults):g})")
        if fault.kind in NETWORK_KINDS and not hosts:
            raise FaultSpecError(f"{fault}: a network fault needs nodes with networks of their own; "
                                 "run with --hosts")
        if fault.step >= steps:
            raise FaultSpecError(f"{fault}: step {fault.step} is beyond the job's train.steps={steps} "
                                 f"(steps are 0 to {steps - 1}); use an earlier step or raise train.steps")
        if fault.kind == "add-node":
            launched += 1
            continue
        if fault.kind in ETCD_KINDS:
            if etcd_members < 3:
                raise FaultSpecError(f"{fault}: etcd has {etcd_members} member(s); losing one would "
                                     "lose etcd. Run with --etcd-members 3")
            if fault.node is not None and fault.node >= etcd_members:
                raise FaultSpecError(f"{fault}: etcd members are 0 to {etcd_members - 1}")
            continue
        if fault.group and (max(fault.group) >= launched or len(fault.group) >= launched):
            raise FaultSpecError(f"{fault}: a partition cuts some of the nodes 0 to {launched - 1} by step "
                                 f"{fault.step} from the others; name a group of them that leaves some out")
        if fault.node is not None and fault.node >= launched:
            raise FaultSpecError(f"{fault}: there is no node {fault.node} by step {fault.step}; nodes "
                                 f"are 0 to {launched - 1} (add-node adds the next index)")
        if fault.local is not None and fault.local >= nproc:
            raise FaultSpecError(f"{fault}: nodes have {nproc} worker(s), local ranks 0 to {nproc - 1}")
