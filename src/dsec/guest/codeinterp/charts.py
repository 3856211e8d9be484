"""Matplotlib figures as E2B chart data (``e2b/chart``). Filled in below."""

from __future__ import annotations

from typing import Any


def figure_to_chart(fig: Any) -> dict[str, Any] | None:
    return None
