"""The tier conformance suite, unchanged, through the cluster apiserver (container tier).

Every test of ``tests/conformance/test_conformance.py`` runs here against ``dsec serve
--cluster`` in front of three Ray nodes: the same SDK calls, now routed to edge actors.
"""

from __future__ import annotations

import pytest
from tests.conformance.conftest import caps, make_sandbox, sandbox  # noqa: F401 (fixtures)
from tests.conformance.test_conformance import *  # noqa: F403 (the suite itself)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.root]
