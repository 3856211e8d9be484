"""Cluster mode on Ray: one edge actor per node, a stateless apiserver in front of them.

* :class:`ClusterEdge` (``dsec.cluster.edge``): the apiserver's
  :class:`~dsec.contract.edge.EdgeAPI` for a Ray cluster (routing, placement,
  admission retries, node loss);
* :class:`EdgeActor` (``dsec.cluster.actor``): the per-node edge, pinned to its node;
* :class:`ClusterState` (``dsec.cluster.state``): the PostgreSQL registry;
* :func:`migrate_sandbox` (``dsec.cluster.migrate``): moving sandboxes between nodes.

Ray and psycopg are imported lazily (the ``cluster`` extra); design notes and how to run
it: ``docs/design/cluster.md``.
"""

from dsec.cluster.actor import NodeConfig
from dsec.cluster.edge import (
    BURSTABLE_LABEL,
    PREFER_NODE_LABEL,
    ClusterEdge,
    ClusterOptions,
    NodeLost,
    node_of_sandbox,
)

__all__ = [
    "BURSTABLE_LABEL",
    "PREFER_NODE_LABEL",
    "ClusterEdge",
    "ClusterOptions",
    "NodeConfig",
    "NodeLost",
    "node_of_sandbox",
]
