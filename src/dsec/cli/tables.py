"""Tables of the ``dsec`` CLI that fit the terminal.

A table is a list of :class:`Column` (each with a *priority*: 0 is essential, higher numbers
are dropped first) and rows of strings (rich markup allowed). :func:`fit_table` measures
every column's natural width and drops the least important columns until the table fits the
terminal's width (``$COLUMNS``, else the terminal, else 80); ``wide=True`` keeps them all.
Nothing is ever cut with an ellipsis: a column still too wide for what is left *folds* its
text onto more lines, and an ``id`` column is given its full width whenever the terminal
has room for it, so a sandbox id can always be copied whole.

``--output json`` is the form for scripts: every command that prints a table prints the same
data as JSON instead (:func:`print_json`).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["Column", "OutputFormat", "fit_table", "print_json", "print_table", "terminal_width"]

GAP = 2
"""Spaces between two columns."""


class OutputFormat(StrEnum):
    """``--output`` of the listing commands."""

    table = "table"
    wide = "wide"
    json = "json"


@dataclass(frozen=True)
class Column:
    """One column: ``priority`` 0 is never dropped, higher ones go first when the terminal is
    narrow; ``is_id``: a column of identifiers (kept whole: folded, never shortened);
    ``folds_to``: free text that folds onto more lines, down to this width, before anything
    is dropped for it."""

    header: str
    priority: int = 0
    justify: Literal["left", "right"] = "left"
    is_id: bool = False
    folds_to: int | None = None


def terminal_width() -> int:
    """``$COLUMNS``, else the terminal's width, else 80."""
    return shutil.get_terminal_size((80, 24)).columns


def _cell_len(cell: str) -> int:
    return max((Text.from_markup(line).cell_len for line in cell.split("\n")), default=0)


def fit_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    wide: bool = False,
    title: str | None = None,
) -> Table:
    """A rich table of ``rows`` under ``columns`` that fits ``width`` (default: the terminal)
    by dropping the least important columns (unless ``wide``)."""
    width = width or terminal_width()
    natural = [
        max([len(c.header), *(_cell_len(r[i]) for r in rows)]) for i, c in enumerate(columns)
    ]
    keep = list(range(len(columns)))

    def need(i: int) -> int:
        folds_to = columns[i].folds_to
        return natural[i] if folds_to is None else min(natural[i], folds_to)

    def total(idx: list[int]) -> int:
        return sum(need(i) for i in idx) + GAP * (len(idx) - 1)

    if not wide:
        while total(keep) > width:
            droppable = [i for i in keep if columns[i].priority > 0]
            if not droppable:
                break
            # the least important; among equals, the rightmost
            keep.remove(max(droppable, key=lambda i: (columns[i].priority, i)))
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, GAP // 2), title=title)
    for i in keep:
        c = columns[i]
        table.add_column(
            c.header,
            justify=c.justify,
            overflow="fold",
            min_width=natural[i] if c.is_id and natural[i] <= width else None,
        )
    for r in rows:
        table.add_row(*(r[i] for i in keep))
    return table


def print_table(console: Console, table: Table, *, wide: bool = False) -> None:
    """Print ``table`` on ``console``'s stream at the terminal's width (``wide``: as wide as
    it needs; colours as ``console`` has them)."""
    out = Console(
        file=console.file,
        width=100_000 if wide else terminal_width(),
        highlight=False,
        soft_wrap=False,
        color_system=console.color_system,  # type: ignore[arg-type]
        force_terminal=console.is_terminal,
    )
    out.print(table, crop=not wide)


def print_json(value: Any) -> None:
    """``value`` (models are dumped in their JSON form) as indented JSON on stdout."""

    def plain(v: Any) -> Any:
        if hasattr(v, "model_dump"):
            return v.model_dump(mode="json")
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    sys.stdout.write(json.dumps(plain(value), indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()
