"""The edge's table of live sandboxes, with the running totals admission needs.

Admission used to sum the requests of every live sandbox on each create (twice): with 2,000
live that is 4,000 dict lookups per create, and the cost grew with the live count. The table
keeps the sums as entries come and go (for the node and for each owner: the per-key quotas
of :mod:`dsec.edge.quotas`), so admission, :meth:`EdgeAgent.usage` and the lookups on create,
kill and list are O(1) in the number of live sandboxes.

Example::

    table: LiveTable[str] = LiveTable()
    table.add("sb-1", "entry", cpu=0.5, memory_mb=256, owner="k1")
    assert table.requested_cpu == 0.5 and len(table) == 1
    assert table.owner_usage("k1") == (1, 0.5, 256)
    table.pop("sb-1")
    assert table.requested_cpu == 0.0 and table.owner_usage("k1") == (0, 0.0, 0)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["LiveTable"]

E = TypeVar("E")


class LiveTable(Generic[E]):
    """Sandbox id -> entry, plus the requested cores and memory (MiB) of all entries and of
    each owner's.

    Each entry's request is recorded when it is added, so the totals stay exact whatever
    happens to the entry afterwards. Replacing an id's entry replaces its request."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[E, float, int, str]] = {}
        self._cpu = 0.0
        self._memory_mb = 0
        self._owners: dict[str, list[float]] = {}  # owner -> [count, cpu, memory_mb]

    def add(
        self, sandbox_id: str, entry: E, *, cpu: float, memory_mb: int, owner: str = ""
    ) -> None:
        """Add (or replace) ``sandbox_id`` of ``owner`` requesting ``cpu`` cores and
        ``memory_mb`` MiB."""
        self.pop(sandbox_id)
        self._entries[sandbox_id] = (entry, float(cpu), int(memory_mb), owner)
        self._cpu += float(cpu)
        self._memory_mb += int(memory_mb)
        o = self._owners.setdefault(owner, [0, 0.0, 0])
        o[0] += 1
        o[1] += float(cpu)
        o[2] += int(memory_mb)

    def pop(self, sandbox_id: str) -> E | None:
        """Remove ``sandbox_id``; its entry, or None if it was not there."""
        old = self._entries.pop(sandbox_id, None)
        if old is None:
            return None
        entry, cpu, mem, owner = old
        self._memory_mb -= mem
        if self._entries:
            self._cpu -= cpu
        else:  # no float drift left behind once the node is empty
            self._cpu = 0.0
        o = self._owners[owner]
        o[0] -= 1
        o[1] -= cpu
        o[2] -= mem
        if o[0] <= 0:
            del self._owners[owner]
        return entry

    def owner_usage(self, owner: str) -> tuple[int, float, int]:
        """``(sandboxes, cores, MiB)`` requested by ``owner``'s live entries."""
        o = self._owners.get(owner)
        if o is None:
            return (0, 0.0, 0)
        return (int(o[0]), max(0.0, o[1]), int(o[2]))

    def get(self, sandbox_id: str) -> E | None:
        item = self._entries.get(sandbox_id)
        return item[0] if item is not None else None

    def __getitem__(self, sandbox_id: str) -> E:
        return self._entries[sandbox_id][0]

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def values(self) -> list[E]:
        """A snapshot of the entries (safe to iterate while the table changes)."""
        return [item[0] for item in self._entries.values()]

    @property
    def requested_cpu(self) -> float:
        """Cores requested by all live sandboxes."""
        return max(0.0, self._cpu)

    @property
    def requested_memory_mb(self) -> int:
        """MiB requested by all live sandboxes."""
        return self._memory_mb
