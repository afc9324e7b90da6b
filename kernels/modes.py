"""The names of the kernel modes and of the environment variable that overrides them.

Free of torch and Triton, so that a config can be checked where neither is imported
(a node's agent reads the job's config and never computes).
"""

MODES = ("auto", "triton", "reference")
"""`model.kernels`: "auto" (Triton where it can run), "triton" (warn where it cannot),
"reference" (PyTorch always)."""
ENV = "PLANARIA_KERNELS"
"""`triton` or `reference`, overriding "auto" and "triton" (see `dispatch`)."""
