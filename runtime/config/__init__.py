"""The job's configuration: its sections (`sections`), how a YAML file and overrides
become one (`loading`), the checks across keys and the plan of an explicit layout
(`validation`), and the configuration half of the Hugging Face mapping (`hf_config`).

A node's agent reads configs and never computes: nothing here imports torch, Triton or
the kernels, not even inside a function. Imports `planaria.runtime.contract` and
`planaria.templates` only; every other room imports this one.
"""
