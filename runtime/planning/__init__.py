"""The plan of a configured job: the planner asked with the analytic cost model of a
hardware preset (`job_plans`, which a node's agent loads: it imports no torch), or with
costs measured on this machine (`measured_costs`, with the pipeline runtime's own cost
from `pipeline_probe`).

Imports `planaria.runtime.parallel` (measuring runs the engine's pieces), `.models` and
`.config`; never the layer state or the worker.
"""
