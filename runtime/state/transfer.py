"""Copying layer state between workers when the plan changes (docs/recovery.md).

A `Transfer` (from `planaria.templates.plan.transfers_from`) names one (layer, tp rank)
shard, a worker that holds it and a worker of the new plan that needs it. What moves is
everything the shard's next optimizer step depends on: its parameters (the fp32 master
weights: parameters are kept in the master dtype, autocast makes the low-precision
copies) and its AdamW state (both moments and the step count). A tp shard moves as a
unit, so tensor-parallel layers move shard by shard.

Workers of nodes leaving with notice (a planned leave: `EpochRecord.leaving`) are in no
plan, so the new epoch's world has no rank for them; the shards only they hold travel
over a group of their own, made from the epoch's rendezvous store by them and the
workers they send to (`Handoff`, `exchange_handoff`), beside the world's transfers.

All transfers between one pair of workers travel as one message per dtype, flattened in
the transfer list's order (every worker reads the same list, so both sides agree on the
layout without a handshake). Messages go through `torch.distributed.batch_isend_irecv`
on the new epoch's world group, so every pair proceeds at once: the load spreads over
all surviving sources, as `transfers_from` chose them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Mapping

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from planaria.runtime.contract.exactly_once import CommitRecord
from planaria.runtime.parallel.optim import empty_adam_state
from planaria.templates.plan import Transfer, Worker

if TYPE_CHECKING:
    from planaria.runtime.parallel.engine import Engine, LayerState

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class TransferStats:
    """What this worker sent and received, and how long the exchange took."""

    layers_sent: int
    layers_received: int
    bytes_sent: int
    bytes_received: int
    seconds: float

    def __add__(self, other: "TransferStats") -> "TransferStats":
        return TransferStats(*(a + b for a, b in zip(self.__dict__.values(), other.__dict__.values())))


def layer_state_tensors(state: "LayerState", stepped: bool) -> list[torch.Tensor]:
    """The tensors of a layer shard that move, in a fixed order: each parameter, then (once
    the optimizer has stepped) its moments and step count."""
    tensors = []
    for param in state.module.parameters():
        tensors.append(param.data)
        if stepped:
            moments = state.optimizer.state[param]
            tensors.extend(moments[key] for key in _ADAM_KEYS)
            tensors.append(moments["step"].view(1))
    return tensors


def _empty_optimizer_state(state: "LayerState") -> None:
    """AdamW's per-parameter state, zeroed, to be overwritten by what arrives."""
    for param in state.module.parameters():
        state.optimizer.state[param] = empty_adam_state(state.optimizer, param)


def on_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`tensors` as the communication backend needs them: on `device`. AdamW keeps its
    step count on the CPU beside GPU parameters, and NCCL moves GPU tensors only, so
    those few scalars travel as staged copies (the others are returned as they are)."""
    return [t if t.device == device else t.to(device) for t in tensors]


def exchange_layers(engine: "Engine", transfers: list[Transfer], *, stepped: bool) -> TransferStats:
    """Send the shards this worker is a source of, receive the ones it needs; collective
    over the transfers' workers on `engine.groups.world` (workers in no transfer return
    at once). The received shards are installed (`engine.install_shards`) only once all arrived."""
    started = time.perf_counter()
    me = engine.plan.worker(engine.rank)
    outgoing, incoming, received = _messages(engine, transfers, me, engine.plan.rank_of_worker(), stepped)
    sends = {peer: [_flatten_dense_tensors(on_device(group, engine.device)) for _, group in by_dtype(tensors)]
             for peer, tensors in outgoing.items()}
    _send_and_receive(engine, sends, incoming)
    engine.install_shards(received)
    nbytes = lambda groups: sum(t.numel() * t.element_size() for ts in groups.values() for t in ts)  # noqa: E731
    return TransferStats(layers_sent=sum(t.src == me for t in transfers), layers_received=len(received),
                         bytes_sent=nbytes(outgoing), bytes_received=nbytes(incoming),
                         seconds=time.perf_counter() - started)


def _messages(engine: "Engine", transfers: list[Transfer], me: Worker, rank_of: Mapping[Worker, int],
              stepped: bool):
    """(tensors to send, by peer rank; shells' tensors to receive into, by peer rank;
    the shells, by layer) for this worker's part of `transfers`, in the transfer order
    every worker reads alike; `rank_of` names each worker's rank in the group used."""
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[torch.Tensor]] = {}
    received: dict[int, "LayerState"] = {}
    for t in sorted(transfers, key=lambda t: (t.layer, t.tp_rank, t.src, t.dst)):
        if t.src == me:
            if t.layer not in engine.held_layers():
                raise RuntimeError(f"worker {me} is to send layer {t.layer}, which it does not hold")
            outgoing.setdefault(rank_of[t.dst], []).extend(layer_state_tensors(engine.shard(t.layer), stepped))
        elif t.dst == me:
            received[t.layer] = state = engine.empty_shard(t.layer)
            if stepped:
                _empty_optimizer_state(state)
            incoming.setdefault(rank_of[t.src], []).extend(layer_state_tensors(state, stepped))
    return outgoing, incoming, received


@dataclass(frozen=True)
class SnapshotSource:
    """What a worker restores from when the job goes back to a peer snapshot: the step's
    commit record and the shards this worker keeps of it (`planaria.runtime.state.peer_snapshots`)."""

    commit: CommitRecord
    shards: Mapping[tuple[int, int], tuple[torch.Tensor, ...]]
    """(layer, tp rank) -> the shard flat per dtype (`peer_snapshots.flatten_shard`)."""


def restore_from_snapshots(engine: "Engine", transfers: list[Transfer], source: SnapshotSource) -> TransferStats:
    """Give this worker the plan's layers as they were at the snapshot's step: the shards
    it keeps itself are loaded in place, the others received from the transfers'
    sources, which send their kept copies (not their live layers: those may be newer);
    collective over the transfers' workers, like `exchange_layers`. Installs the shards
    received and kept; the caller drops every other layer first."""
    started = time.perf_counter()
    plan, me, tp_rank = engine.plan, engine.plan.worker(engine.rank), engine.tp.rank
    rank_of = plan.rank_of_worker()
    sends: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    incoming: dict[int, list[torch.Tensor]] = {}
    shells: dict[int, "LayerState"] = {}
    for t in sorted(transfers, key=lambda t: (t.layer, t.tp_rank, t.src, t.dst)):
        if t.src == me:
            sends.setdefault(rank_of[t.dst], []).append(_kept(source, (t.layer, t.tp_rank), me))
        elif t.dst == me:
            shells[t.layer] = _stepped_shell(engine, t.layer)
            incoming.setdefault(rank_of[t.src], []).extend(layer_state_tensors(shells[t.layer], True))
    # One message per dtype and peer, as `exchange_layers` sends: each dtype's flat pieces
    # of the peer's shards, in the transfer order, are what flattening their tensors makes.
    merged = {peer: [torch.cat(pieces) for pieces in zip(*flats)] for peer, flats in sends.items()}
    _send_and_receive(engine, merged, incoming)
    received = len(shells)
    for layer in plan.layers_of(engine.rank):
        if layer not in shells:
            shells[layer] = _stepped_shell(engine, layer)
            load_flat(shells[layer], _kept(source, (layer, tp_rank), me))
    engine.install_shards(shells)
    nbytes = lambda flats: sum(t.numel() * t.element_size() for f in flats for t in f)  # noqa: E731
    return TransferStats(layers_sent=sum(t.src == me for t in transfers), layers_received=received,
                         bytes_sent=sum(nbytes(f) for f in sends.values()),
                         bytes_received=sum(t.numel() * t.element_size() for ts in incoming.values() for t in ts),
                         seconds=time.perf_counter() - started)


def load_flat(state: "LayerState", flat: tuple[torch.Tensor, ...]) -> None:
    """Copy a shard kept flat (`peer_snapshots.flatten_shard`) into a stepped shell."""
    for (_, group), buffer in zip(by_dtype(layer_state_tensors(state, True)), flat, strict=True):
        for target, value in zip(group, _unflatten_dense_tensors(buffer, group)):
            target.copy_(value)


def _kept(source: SnapshotSource, shard: tuple[int, int], me) -> tuple[torch.Tensor, ...]:
    try:
        return source.shards[shard]
    except KeyError:
        raise RuntimeError(f"worker {me} keeps no snapshot of shard {shard} of step "
                           f"{source.commit.iteration}, but the plan counts on it") from None


def _stepped_shell(engine: "Engine", layer: int) -> "LayerState":
    state = engine.empty_shard(layer)
    _empty_optimizer_state(state)
    return state


def _send_and_receive(engine: "Engine", sends: dict[int, list[torch.Tensor]],
                      incoming: dict[int, list[torch.Tensor]]) -> None:
    """Send each peer its flat tensors (one per dtype, tag = the dtype's place) and fill
    `incoming` (each peer's tensors, grouped by dtype the same way), all pairs at once."""
    ops, unpack = [], []
    for peer, flats in sorted(sends.items()):
        for tag, flat in enumerate(flats):
            ops.append(dist.P2POp(dist.isend, on_device([flat], engine.device)[0], peer,
                                  group=engine.groups.world, tag=tag))
    for peer, tensors in sorted(incoming.items()):
        for tag, (dtype, group) in enumerate(by_dtype(tensors)):
            buffer = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=engine.device)
            ops.append(dist.P2POp(dist.irecv, buffer, peer, group=engine.groups.world, tag=tag))
            unpack.append((buffer, group))
    works = dist.batch_isend_irecv(ops) if ops else []
    engine.phase("transfer", engine.plan.first_iteration)
    for work in works:
        work.wait()
    for buffer, group in unpack:
        for target, value in zip(group, _unflatten_dense_tensors(buffer, group)):
            target.copy_(value)  # back to the CPU for a step count (see `on_device`)


def by_dtype(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    """Tensors grouped by dtype (flattening needs one dtype), in order of first appearance;
    both sides list the same tensors in the same order, so the groups and tags agree."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.items())


@dataclass(frozen=True)
class Handoff:
    """The transfers of an epoch whose source is a leaving worker, and where their group
    meets: the epoch's rendezvous store (under a prefix of its own)."""

    transfers: tuple[Transfer, ...]
    store: dist.Store
    backend: str
    timeout: timedelta

    @classmethod
    def of(cls, transfers, leaving: tuple[str, ...], store: dist.Store, backend: str,
           timeout: timedelta) -> "Handoff | None":
        """The handoff among `transfers` (those from a node of `leaving`), or None."""
        mine = tuple(t for t in transfers if t.src[0] in leaving)
        return cls(mine, store, backend, timeout) if mine else None

    def participants(self) -> list[Worker]:
        """Its group's ranks: every source and destination, in order."""
        return sorted({w for t in self.transfers for w in (t.src, t.dst)})

    def group(self, me: Worker) -> dist.ProcessGroup:
        """The handoff's process group, as rank `me` (collective over the participants).
        Made directly on its backend rather than through `dist.new_group`, which is
        collective over the whole world: the leaving workers are in none."""
        from planaria.runtime.parallel.release import group_options

        ranks = self.participants()
        store = dist.PrefixStore("handoff/", self.store)
        if self.backend == "nccl":
            options = group_options("nccl")
            options._timeout = self.timeout
            return dist.ProcessGroupNCCL(store, ranks.index(me), len(ranks), options)
        return dist.ProcessGroupGloo(store, ranks.index(me), len(ranks), self.timeout)


def exchange_handoff(engine: "Engine", handoff: Handoff, me: Worker, *, stepped: bool) -> TransferStats:
    """A planned leave's copies: a leaving worker sends the shards it is the source of,
    a worker of the new plan receives and installs the ones it is the destination of
    (in the flat per-dtype messages of `exchange_layers`); then both wait until every
    participant is done, so that no leaving worker exits while its sends are in flight."""
    started = time.perf_counter()
    ranks = handoff.participants()
    group = handoff.group(me)
    outgoing, incoming, received = _messages(engine, list(handoff.transfers), me,
                                             {w: i for i, w in enumerate(ranks)}, stepped)
    works, unpack, flats = [], [], []  # each send's flat buffer lives until its wait
    for peer, tensors in sorted(outgoing.items()):
        for tag, (_, group_tensors) in enumerate(by_dtype(tensors)):
            flats.append(_flatten_dense_tensors(on_device(group_tensors, engine.device)))
            works.append(group.send([flats[-1]], peer, tag))
    for peer, tensors in sorted(incoming.items()):
        for tag, (dtype, group_tensors) in enumerate(by_dtype(tensors)):
            buffer = torch.empty(sum(t.numel() for t in group_tensors), dtype=dtype, device=engine.device)
            works.append(group.recv([buffer], peer, tag))
            unpack.append((buffer, group_tensors))
    for work in works:
        work.wait()
    for buffer, group_tensors in unpack:
        for target, value in zip(group_tensors, _unflatten_dense_tensors(buffer, group_tensors)):
            target.copy_(value)
    group.allreduce([torch.zeros(1, device=engine.device)]).wait()
    engine.install_shards(received)
    nbytes = lambda groups: sum(t.numel() * t.element_size() for ts in groups.values() for t in ts)  # noqa: E731
    return TransferStats(layers_sent=sum(t.src == me for t in handoff.transfers), layers_received=len(received),
                         bytes_sent=nbytes(outgoing), bytes_received=nbytes(incoming),
                         seconds=time.perf_counter() - started)
