"""run_code: one-shot code runs on the fncall tier."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dsec.edge.core import EdgeCore
from dsec.edge.quotas import code_run_size
from dsec.errors import CapabilityNotSupported, DsecError
from dsec.models import CodeRunRequest, CodeRunResult, RunCodeRequest, RunCodeResponse

if TYPE_CHECKING:
    from dsec.runtimes.fncall.service import CodeRunAdmission, RunCodeService

log = logging.getLogger("dsec.edge")


class CodeVerbs(EdgeCore):
    """run_code: one-shot code runs on the fncall tier."""

    # ------------------------------------------------------------------ run_code
    async def run_code(self, req: CodeRunRequest, owner: str) -> CodeRunResult:
        """:class:`~dsec.contract.edge.CodeRuns`: ``req`` in a fresh fncall worker, admitted
        as a creation of ``owner``'s (``POST /v1/run_code``)."""
        return await self._code_runs().run(req, self._code_run_admission(owner, req))

    async def run_code_sandboxfusion(self, req: RunCodeRequest, owner: str) -> RunCodeResponse:
        """:class:`~dsec.contract.edge.CodeRuns`: SandboxFusion's ``/run_code``, admitted as
        a creation of ``owner``'s."""
        return await self._code_runs().run_code(req, self._code_run_admission(owner, req))

    def _code_runs(self) -> RunCodeService:
        """The node's run_code service over its fncall tier, made on first use."""
        rt = self._runtime("fncall")
        if self.code_runner is None:
            from dsec.runtimes.fncall.runtime import FncallRuntime
            from dsec.runtimes.fncall.service import RunCodeService

            if not isinstance(rt, FncallRuntime):
                raise CapabilityNotSupported(
                    f"the fncall tier of node {self.node} does not run code", tier="fncall"
                )
            self.code_runner = RunCodeService(rt, pod_name=f"dsec-fncall@{self.node}")
        return self.code_runner

    def _code_run_admission(
        self, owner: str, req: CodeRunRequest | RunCodeRequest
    ) -> CodeRunAdmission:
        """What a creation of ``owner``'s passes, for one code run: the key's quota (the run
        counts as one live sandbox of :func:`code_run_size` while it runs, and spends one
        creation of the key's rate) and the node's creation gate around the worker's claim.
        The node's own caps are the fncall pool's (``max_workers``)."""
        from dsec.runtimes.fncall.service import CodeRunAdmission

        cpu, memory_mb = code_run_size(req)

        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            try:
                usage = self.key_usage_now(owner)
                self.key_quotas.check(owner, usage, cpu=cpu, memory_mb=memory_mb)
                self.key_quotas.take(owner)
            except DsecError as e:
                self.metrics.errors.labels(e.code).inc()
                raise
            with self.key_quotas.admitted(owner, cpu=cpu, memory_mb=memory_mb):
                yield

        return CodeRunAdmission(hold=hold, claim_slot=lambda: self.creations.slot(owner))
