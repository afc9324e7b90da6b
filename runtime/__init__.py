"""The PTD-P runtime: what a computing process runs, in rooms.

| room | owns | may import (of the runtime) |
|---|---|---|
| `contract` | what crosses a process boundary: records, keys, logs, env | nothing of the runtime |
| `config` | the job's configuration, its checks, its Hugging Face half | (the contract only) |
| `models` | the LLaMA-style layers, tensor parallelism, Hugging Face weights | `config` |
| `data` | token sources, shards, corpora, `planaria data prepare` | `config` |
| `parallel` | the engine of one epoch: groups, pipelines, gradient sync, optimizer, the loop | `models`, `config` |
| `planning` | the plan of a configured job: analytic, or from measured costs | `parallel`, `models`, `config` |
| `state` | layer state across failures: transfers, snapshots, checkpoints, saves, audit | `parallel`, `models`, `config` |
| `worker` | the computing process: the elastic worker, the torchrun trainer, metrics | every room |

Every room may import the contract. Rooms import downwards only, and no two import each
other, not even inside a function or for an annotation (docs/design.md, "The rooms of
the runtime"; tests/test_import_graph.py holds it). Any room may import
`planaria.templates` and `planaria.kernels`; none imports `planaria.elastic` or
`planaria.chaos`.
"""
