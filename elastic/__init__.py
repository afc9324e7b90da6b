"""The elastic control plane: etcd client, agents, leader, membership, epochs, launcher.

May import `planaria.templates`, `planaria.runtime` and `planaria.kernels`.
"""
