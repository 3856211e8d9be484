"""What the fncall tier keeps of one sandbox (:class:`FncallState`): the JSON of its
:class:`~dsec.contract.runtime.Handle`, read as a typed model. A worker does not outlive the
process that made it: after an edge restart ``recover()`` finds a sandbox only in the
runtime's own table, so the state is what the audit and a reader of the registry need."""

from __future__ import annotations

from dsec.contract.runtime import TierState

__all__ = ["FncallState"]


class FncallState(TierState):
    """One fncall sandbox: the warm worker it claimed.

    Attributes:
        pool: the worker pool's name (its layers).
        wid: the worker's number in its pool.
        pid: the worker's process id.
        auid: the loginuid its commands carry (audit; None: the node does not audit).
    """

    pool: str = ""
    wid: int | None = None
    pid: int | None = None
    auid: int | None = None
