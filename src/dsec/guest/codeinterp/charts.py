"""Matplotlib figures as E2B chart data (the ``e2b/chart`` MIME type, ``Result.chart``).

The shapes are those e2b-code-interpreter's ``charts.py`` reads:

* ``line`` / ``scatter``: ``x_label``, ``y_label``, ``x_unit``, ``y_unit``, ``x_ticks``,
  ``x_tick_labels``, ``x_scale``, ``y_ticks``, ``y_tick_labels``, ``y_scale`` and
  ``elements`` = ``[{"label", "points": [[x, y], ...]}]``;
* ``bar``: the 2-D labels and ``elements`` = ``[{"label", "group", "value"}]``;
* ``pie``: ``elements`` = ``[{"label", "angle" (degrees), "radius"}]``;
* ``superchart``: a figure with several charted axes, ``elements`` = their charts;
* ``unknown``: a figure whose axes hold none of the above.

Every chart has ``type``, ``title`` and ``elements``. Loaded by ``pykernel.py`` only when a
figure is displayed; nothing here runs unless matplotlib is already imported.
"""

from __future__ import annotations

import math
from typing import Any

_SCALES = {"linear", "log", "symlog", "logit", "function", "functionlog", "asinh"}


def _num(value: Any) -> Any:
    """A JSON-friendly x or y value (numbers as floats/ints, dates and others as text)."""
    try:
        if hasattr(value, "item"):
            value = value.item()
    except (TypeError, ValueError):
        pass
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def _scale(axis: Any, name: str) -> str:
    converter = getattr(axis, "converter", None)
    kind = type(converter).__name__ if converter is not None else ""
    if "StrCategory" in kind:
        return "categorical"
    if "Date" in kind:
        return "datetime"
    return name if name in _SCALES else "unknown"


def _categories(axis: Any) -> dict[float, str]:
    units = getattr(axis, "units", None)
    mapping = getattr(units, "_mapping", None)
    if not mapping:
        return {}
    return {float(v): str(k) for k, v in mapping.items()}


def _axis_fields(ax: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for letter, axis, scale in (("x", ax.xaxis, ax.get_xscale()), ("y", ax.yaxis, ax.get_yscale())):
        ticks = [_num(t) for t in axis.get_ticklocs()]
        out[f"{letter}_label"] = axis.get_label_text() or None
        out[f"{letter}_unit"] = None
        out[f"{letter}_ticks"] = ticks
        out[f"{letter}_tick_labels"] = [t.get_text() for t in axis.get_ticklabels()]
        out[f"{letter}_scale"] = _scale(axis, scale)
    return out


def _label(artist: Any, index: int, default: str) -> str:
    label = str(artist.get_label() or "")
    return f"{default} {index + 1}" if not label or label.startswith("_") else label


def _points(ax: Any, xs: Any, ys: Any) -> list[list[Any]]:
    xcat, ycat = _categories(ax.xaxis), _categories(ax.yaxis)
    out = []
    for x, y in zip(xs, ys, strict=False):
        xv, yv = _num(x), _num(y)
        if xcat and isinstance(xv, int | float):
            xv = xcat.get(float(xv), xv)
        if ycat and isinstance(yv, int | float):
            yv = ycat.get(float(yv), yv)
        out.append([xv, yv])
    return out


def _is_grid_line(line: Any, ax: Any) -> bool:
    return line in ax.xaxis.get_gridlines() or line in ax.yaxis.get_gridlines()


def axes_to_chart(ax: Any) -> dict[str, Any] | None:
    """One axes as a chart, or None if it holds nothing charted."""
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge

    title = ax.get_title() or None
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        texts = [t.get_text() for t in ax.texts]
        elements = []
        for i, wedge in enumerate(wedges):
            label = (
                texts[2 * i]
                if len(texts) >= 2 * len(wedges)
                else (texts[i] if i < len(texts) else _label(wedge, i, "slice"))
            )
            elements.append(
                {
                    "label": label,
                    "angle": abs(wedge.theta2 - wedge.theta1),
                    "radius": float(wedge.r),
                }
            )
        return {"type": "pie", "title": title, "elements": elements}
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        fields = _axis_fields(ax)
        horizontal = any(getattr(c, "orientation", "vertical") == "horizontal" for c in bars)
        cats = _categories(ax.yaxis if horizontal else ax.xaxis)
        elements = []
        for gi, container in enumerate(bars):
            group = _label(container, gi, "group")
            for rect in container.patches:
                if horizontal:
                    where, value = rect.get_y() + rect.get_height() / 2, rect.get_width()
                else:
                    where, value = rect.get_x() + rect.get_width() / 2, rect.get_height()
                label = cats.get(float(round(where)), None) if cats else None
                elements.append(
                    {
                        "label": label if label is not None else _num(where),
                        "group": group,
                        "value": _num(value),
                    }
                )
        return {
            "type": "bar",
            "title": title,
            **{k: fields[k] for k in ("x_label", "y_label", "x_unit", "y_unit")},
            "elements": elements,
        }
    lines = [ln for ln in ax.get_lines() if not _is_grid_line(ln, ax)]
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    if lines:
        elements = [
            {"label": _label(ln, i, "line"), "points": _points(ax, ln.get_xdata(), ln.get_ydata())}
            for i, ln in enumerate(lines)
        ]
        return {"type": "line", "title": title, **_axis_fields(ax), "elements": elements}
    if scatters:
        elements = []
        for i, coll in enumerate(scatters):
            offsets = coll.get_offsets()
            elements.append(
                {
                    "label": _label(coll, i, "scatter"),
                    "points": _points(ax, [o[0] for o in offsets], [o[1] for o in offsets]),
                }
            )
        return {"type": "scatter", "title": title, **_axis_fields(ax), "elements": elements}
    return None


def figure_to_chart(fig: Any) -> dict[str, Any]:
    """The chart of a figure: one axes' chart, a ``superchart`` of several, or ``unknown``."""
    charts = [c for c in (axes_to_chart(ax) for ax in fig.get_axes()) if c is not None]
    suptitle = getattr(fig, "_suptitle", None)
    title = suptitle.get_text() if suptitle is not None else None
    if len(charts) == 1:
        chart = charts[0]
        if title and not chart.get("title"):
            chart["title"] = title
        return chart
    if charts:
        return {"type": "superchart", "title": title, "elements": charts}
    return {"type": "unknown", "title": title, "elements": []}
