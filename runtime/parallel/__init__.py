"""The parallel engine of one epoch: the `engine` (pipelined forward and backward, the
gradient sync over replica groups, the commit, clipping and the step), the process
`groups` of an epoch and their `release` when the control plane declares it failed, the
`pipeline` schedules, the per-layer optimizer and learning-rate schedule (`optim`), the
one training `loop`, and the single-process `reference` it is checked against.

Imports `planaria.runtime.models`, `.config` and `.contract`; never the layer state
(`planaria.runtime.state` fills an epoch's layers through the engine's `LayerSource`
protocol), the planning or the worker.
"""
