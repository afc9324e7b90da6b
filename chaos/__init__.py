"""Chaos harness, fault injection, local clusters, reports, the trace simulator, and the CLI.

Sits at the top of the import graph: may import every other part of Planaria.
"""
