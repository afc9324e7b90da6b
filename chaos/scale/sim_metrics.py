"""A simulated worker's reads for its metrics writer (logging.tensorboard), made by the
runtime's own `EpochMetrics` over the worker's store.

A real epoch's rank 0 writes the run's TensorBoard events (`EpochMetrics.component`,
`planaria.runtime.worker.metrics_writer.RunWriter`), and reads from the store what it
writes of the job's epochs: its own epoch's change, and, as it takes the run's
directory over, the changes of the epochs no writer wrote. Which epochs those are
depends on what the directory holds, which the writers of every node share:
`MetricsDirectory` is that, reduced to the newest epoch whose change was written.
"""
from __future__ import annotations

import threading

from planaria.runtime.worker.epoch_metrics import EpochMetrics


class MetricsDirectory:
    """The run's TensorBoard directory as its writers share it (`RunWriter`), reduced to
    what decides store reads: the newest epoch whose change a writer wrote. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.last_epoch = -1

    def wrote(self, epoch: int) -> None:
        with self._lock:
            self.last_epoch = max(self.last_epoch, epoch)


_UNPUBLISHED = object()
"""`EpochMetrics.epoch_change`'s answer for a record not published yet (as `absent`)."""


class MetricsReads:
    """The store reads of an epoch's rank 0 for its metrics writer (logging.tensorboard:
    `EpochMetrics.component`), made by the runtime's own `EpochMetrics`: after each
    committed step until it found its epoch's record, the epoch's change (the record,
    the controller's account); at its first, as it takes the directory over, the
    changes of the epochs since the last one a writer wrote (`EpochMetrics._history`)."""

    def __init__(self, metrics: EpochMetrics, directory: MetricsDirectory):
        self.metrics, self.directory = metrics, directory
        self.begin(-1)

    def begin(self, epoch: int) -> None:
        self.epoch, self.first_commit_s, self.change_written, self.took_over = epoch, None, False, False

    def after_commit(self, at: float) -> None:
        self.first_commit_s = self.first_commit_s or at
        if not self.change_written:
            change = self.metrics.epoch_change(self.epoch, self.first_commit_s, absent=_UNPUBLISHED)
            self.change_written = change is not _UNPUBLISHED
        if not self.took_over:
            self.took_over = True
            for missed in range(self.directory.last_epoch + 1, self.epoch):
                self.metrics.epoch_change(missed)
        if self.change_written:
            self.directory.wrote(self.epoch)
