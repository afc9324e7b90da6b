"""Shared by every test directory.

`planaria.kernels` is imported before anything else can import Triton: on a machine
without a GPU it sets TRITON_INTERPRET=1 first, and Triton reads it when it decorates
its own library (see planaria.kernels.dispatch).
"""
import planaria.kernels  # noqa: F401
