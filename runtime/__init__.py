"""The PTD-P runtime: what a computing process runs, in rooms.

| room | owns | may import (of the runtime) |
|---|---|---|
| `contract` | what crosses a process boundary: records, keys, logs, env | nothing (and `planaria.templates`) |
| `config` | the job's configuration, its checks, its Hugging Face half | `contract` |
| `models` | the LLaMA-style layers, tensor parallelism, Hugging Face weights | `config` |
| `data` | token sources, shards, corpora, `planaria data prepare` | `config`, `contract` |
| `parallel` | the engine of one epoch: groups, pipelines, gradient sync, optimizer, the loop | `models`, `config`, `contract` |
| `planning` | the plan of a configured job: analytic, or from measured costs | `parallel`, `models`, `config` |
| `state` | layer state across failures: transfers, snapshots, checkpoints, saves, audit | `parallel`, `models`, `config`, `contract` |
| `worker` | the computing process: the elastic worker, the torchrun trainer, metrics | every room |

Rooms import downwards only, and no two import each other (docs/design.md, "Map";
tests/test_import_graph.py holds it). Any room may import `planaria.templates` and
`planaria.kernels`; none imports `planaria.elastic` or `planaria.chaos`.
"""
