"""A real etcd on loopback for the control-plane tests (one per test module)."""
from __future__ import annotations

import pytest

from planaria.elastic.etcd_server import EmbeddedEtcd


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcd() as server:
        yield server
