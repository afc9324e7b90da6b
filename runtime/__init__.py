"""The PTD-P runtime: model, tensor parallelism, pipelines, gradient sync, optimizer, data, trainer.

May import `planaria.templates` and `planaria.kernels`, never `planaria.elastic`
or `planaria.chaos`.
"""
