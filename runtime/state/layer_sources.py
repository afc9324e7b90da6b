"""Where an epoch's layers come from: the kinds of `LayerSource` that
`Engine.enter_epoch` fills an epoch with (`planaria.runtime.parallel.engine`).

- `FromReplicas(transfers, handoff)`: the layers this rank lacks received from workers
  that hold them (parameters and optimizer state, `transfer.exchange_layers`), and with
  a handoff, those only leaving workers hold, over the handoff's own group;
- `FromSnapshots(snapshot, transfers)`: every layer of the plan as it was at a peer
  snapshot's step, from this worker's kept copies or sent by the transfers' sources from
  theirs (`transfer.restore_from_snapshots`); the live layers are dropped;
- `FromCheckpoint(directory)`: every layer of the plan loaded from a disk checkpoint
  (parameters, optimizer state, the step and its commit record).

Without a source, an epoch keeps what the worker holds, and only a new job builds its
layers from their seeds. A source records what it moved (`stats`; None for a
checkpoint, which moves nothing between workers).

The engine sees only the protocol, so the parallel room never imports this one: the
state of layers is built on the engine, not the engine on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from planaria.runtime.contract.checkpoint_layout import read_manifest
from planaria.runtime.contract.exactly_once import CommitRecord
from planaria.runtime.state.checkpoints import load_layer, read_layer
from planaria.runtime.state.transfer import (Handoff, SnapshotSource, TransferStats, exchange_handoff,
                                             exchange_layers, restore_from_snapshots)
from planaria.templates.plan import Transfer

if TYPE_CHECKING:
    from planaria.runtime.parallel.engine import Engine


@dataclass
class FromReplicas:
    """The layers this rank lacks, received from their holders (collective with every
    other worker's `enter_epoch` of the same plan)."""

    transfers: list[Transfer]
    handoff: Handoff | None = None
    """The transfers from leaving workers, over their own group, when this worker takes part."""
    restores: ClassVar[bool] = False
    stats: TransferStats | None = field(default=None, init=False)

    def fill(self, engine: Engine) -> None:
        stepped = engine.last_stepped >= 0
        self.stats = exchange_layers(engine, self.transfers, stepped=stepped)
        if self.handoff is not None:
            me = engine.plan.worker(engine.rank)
            self.stats += exchange_handoff(engine, self.handoff, me, stepped=stepped)


@dataclass
class FromSnapshots:
    """Every layer of the plan as it was at the peer snapshot's step."""

    snapshot: SnapshotSource
    transfers: list[Transfer]
    restores: ClassVar[bool] = True
    stats: TransferStats | None = field(default=None, init=False)

    def fill(self, engine: Engine) -> None:
        engine.check_restore(self.snapshot.commit.iteration, "the snapshot")
        self.stats = restore_from_snapshots(engine, self.transfers, self.snapshot)
        engine.resume_at(self.snapshot.commit)


@dataclass
class FromCheckpoint:
    """Every layer of the plan loaded from a complete checkpoint's directory."""

    directory: Path
    restores: ClassVar[bool] = True
    stats: TransferStats | None = field(default=None, init=False)

    def fill(self, engine: Engine) -> None:
        manifest = read_manifest(self.directory)
        step = manifest["iteration"]
        engine.check_restore(step, f"the checkpoint {self.directory}")
        shards = {}
        for index in engine.plan.layers_of(engine.rank):
            shards[index] = engine.empty_shard(index)
            load_layer(shards[index], read_layer(self.directory, index, engine.tp.rank))
        engine.install_shards(shards)
        engine.resume_at(CommitRecord(step, manifest["loss"], manifest["grad_norm"]))

