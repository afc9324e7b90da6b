"""Training data: the token sources and the step -> samples mapping (`token_datasets`), the
token-shard format (`shards`), and `planaria data prepare`, corpora in (`corpus`) and
shards out (`prepare`).

Imports `planaria.runtime.config` (its error type) and `planaria.runtime.contract` (its
atomic writes) only: no torch, no model, no process group. The mapping from a step to
its samples depends on the seed, the step and the batch alone, never on the plan.
"""
