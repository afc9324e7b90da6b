"""Replica audit: are the replicas of every layer still bit-identical?

Recovery copies a lost layer from any surviving replica, so it silently assumes that
all replicas agree. They should: they receive the same synced gradient and the same
clip coefficient, and run the same deterministic update. Silent data corruption (a
flipped bit in memory) or a bug breaks that without any error. Every
`audit.every` steps each worker checksums the layer shards it holds
(parameters and optimizer state, bit for bit), the replicas of each shard gather their
checksums over the shard's gradient-sync group, and any disagreement is reported with
the layer and the ranks on each side. With `audit.repair`, a shard whose
replicas have a strict majority is overwritten from it (a broadcast from the first
rank of the majority); a tie cannot be repaired and is only reported.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from planaria.runtime.contract.logs import Mismatch
from planaria.runtime.state.transfer import layer_state_tensors, on_device

if TYPE_CHECKING:
    from planaria.runtime.parallel.engine import Engine, LayerState

_MODULUS = 65521  # weights by position modulo a prime, so swapped values change the sum


def shard_tensors(state: "LayerState") -> list[torch.Tensor]:
    """Every tensor of a shard's state, in the order state transfer moves them
    (`layer_state_tensors`): parameters, and their AdamW state once it exists."""
    return layer_state_tensors(state, stepped=bool(state.optimizer.state))


def shard_checksum(state: "LayerState") -> torch.Tensor:
    """Two int64 sums over the raw bits of the shard's tensors: plain, and weighted by
    position. Equal states give equal checksums on any machine; a flipped bit changes both."""
    plain = torch.zeros((), dtype=torch.int64)
    weighted = torch.zeros((), dtype=torch.int64)
    for tensor in shard_tensors(state):
        bits = _as_integers(tensor.detach().reshape(-1).cpu())
        weights = torch.arange(bits.numel(), dtype=torch.int64) % _MODULUS + 1
        plain += bits.sum()
        weighted += (bits * weights).sum()
    return torch.stack([plain, weighted])


def _as_integers(flat: torch.Tensor) -> torch.Tensor:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(view).to(torch.int64)


def audit_replicas(engine: "Engine", repair: bool) -> list[Mismatch]:
    """Compare every shard this worker holds with its replicas (collective over the
    engine's gradient-sync groups; every worker of the epoch must call it)."""
    mismatches = []
    for bucket in engine.groups.buckets:
        if bucket.group is None:
            continue
        # Checksums are summed on the CPU; NCCL gathers GPU tensors only.
        local = torch.stack([shard_checksum(engine.shard(layer)) for layer in bucket.layers]).to(engine.device)
        gathered = [torch.empty_like(local) for _ in bucket.ranks]
        dist.all_gather(gathered, local, group=bucket.group)
        for i, layer in enumerate(bucket.layers):
            found = _compare(layer, engine.tp.rank, bucket.ranks, [tuple(g[i].tolist()) for g in gathered])
            if found is None:
                continue
            if repair and found.majority:
                source = bucket.ranks.index(found.majority[0])
                tensors = shard_tensors(engine.shard(layer))
                for tensor, staged in zip(tensors, on_device(tensors, engine.device)):
                    dist.broadcast(staged, group=bucket.group, group_src=source)
                    if staged is not tensor:
                        tensor.copy_(staged)
                found = Mismatch(found.layer, found.tp_rank, found.majority, found.minority, True)
            mismatches.append(found)
    return mismatches


def _compare(layer: int, tp_rank: int, ranks: tuple[int, ...], sums: list[tuple]) -> Mismatch | None:
    counts = Counter(sums)
    if len(counts) == 1:
        return None
    (top, n), *rest = counts.most_common()
    if rest and rest[0][1] == n:  # a tie: nobody to trust
        return Mismatch(layer, tp_rank, (), tuple(ranks), False)
    return Mismatch(layer, tp_rank, tuple(r for r, s in zip(ranks, sums) if s == top),
                    tuple(r for r, s in zip(ranks, sums) if s != top), False)
