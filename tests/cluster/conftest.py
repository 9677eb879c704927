"""The cluster tests' shared fixture: simulated nodes with a real etcd cluster on them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tether.testing.etcd import EtcdCluster, etcd_on_nodes
from tether.testing.nodes import SimCluster


@pytest.fixture
def etcd() -> Iterator[EtcdCluster]:
    """Three simulated nodes, one member of a real etcd cluster on each; all removed after the
    test, whatever happened."""
    cluster = SimCluster(3).build()
    try:
        with etcd_on_nodes(cluster) as members:
            yield members
    finally:
        cluster.close()
