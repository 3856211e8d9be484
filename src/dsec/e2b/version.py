"""The E2B versions dsec answers as (read by the control plane and the template API)."""

from __future__ import annotations

__all__ = ["ENVD_VERSION"]

ENVD_VERSION = "0.6.4"
"""The envd version dsec reports. It gates SDK features: stdin, close_stdin,
octet-stream uploads, file metadata, watch entries and ``allow_network_mounts`` (dsec
sandboxes have no network mounts: there is nothing it could hide) are on."""
