"""The contract between the control plane and the workers: what crosses a process boundary.

Typed records (frozen dataclasses with an exact JSON round trip: `record`), the job
store's key layout (`keys`), the environment a launcher gives its workers (`env`), the
exactly-once rule over the workers' statuses (`exactly_once`), the files of saves and
checkpoints and the per-worker logs (`checkpoint_layout`, `logs`), and the heartbeat
file (`heartbeat`). A node's agent, the leader's controller, the chaos harness and its
report read and write the same types as the workers.

Nothing in this package imports torch, the kernels, or any other part of the runtime:
an agent, which never computes, imports it without paying for torch, and
tests/test_import_graph.py fails the build if that ever changes. It may import
`planaria.templates` (the plan contract, which the epoch record carries).
"""
