"""The container tier's renderings of the seccomp policy (:mod:`dsec.contract.isolation`).

Two programs enforce it here: the OCI runtime (crun/runc) for the container's PID 1 and
everything it forks, and ``dsec_execd`` for every command run through the exec server. Both
renderings below come from the same :data:`~dsec.contract.isolation.RULES` tuple, so the two
filters cannot differ (a unit test checks they name the same rules).
"""

from __future__ import annotations

from typing import Any

from dsec.contract.isolation import ARCHITECTURES, RULES, SeccompRule

__all__ = ["execd_policy_lines", "oci_seccomp"]

_OCI_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "x86": "SCMP_ARCH_X86", "x32": "SCMP_ARCH_X32"}
_OCI_OP = {"eq": "SCMP_CMP_EQ", "masked_eq": "SCMP_CMP_MASKED_EQ"}


def oci_seccomp(rules: tuple[SeccompRule, ...] = RULES) -> dict[str, Any]:
    """The ``linux.seccomp`` object of an OCI runtime config (crun and runc read it)."""
    syscalls: list[dict[str, Any]] = []
    for r in rules:
        entry: dict[str, Any] = {
            "names": [r.syscall],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": r.errno,
        }
        if r.arg is not None:
            index, op, a, b = r.arg
            entry["args"] = [{"index": index, "value": a, "valueTwo": b, "op": _OCI_OP[op]}]
        syscalls.append(entry)
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": [_OCI_ARCH[a] for a in ARCHITECTURES],
        "syscalls": syscalls,
    }


def execd_policy_lines(rules: tuple[SeccompRule, ...] = RULES) -> list[str]:
    """The seccomp part of ``dsec_execd``'s policy file (see ``dsec_execd.c``)."""
    lines = [f"arch {a}" for a in ARCHITECTURES]
    for r in rules:
        if r.arg is None:
            lines.append(f"deny {r.syscall} {r.errno}")
        else:
            index, op, a, b = r.arg
            lines.append(f"deny_arg {r.syscall} {r.errno} {index} {op} {a} {b}")
    return lines
