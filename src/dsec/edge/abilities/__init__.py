"""The edge's abilities: one module per group of verbs, each a mixin over
:class:`dsec.edge.core.EdgeCore`, composed into :class:`dsec.edge.agent.EdgeAgent`."""
