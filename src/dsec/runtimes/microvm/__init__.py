"""The ``microvm`` tier: QEMU microvm guests restored from per-image memory templates."""

from dsec.runtimes.microvm.runtime import MicroVMConfig, MicroVMRuntime

__all__ = ["MicroVMConfig", "MicroVMRuntime"]
