"""Keep each test's outcome on its item (``item.rep_call``), so factory fixtures can print
their evidence (a VM's console) when the test failed."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome: Any = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
