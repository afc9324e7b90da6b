"""The computing process: the elastic worker's epoch loop (`elastic_worker`), the torchrun
trainer (`trainer`, `python -m planaria.train`), the one engine factory (`build`), the
worker's side of the control plane (`coordination`, `abandonable_store`), injected
faults (`fault_injection`), and the training metrics it writes (`step_metrics`,
`metrics_writer`).

The top room: it may import every other room of the runtime, and none imports it.
"""
