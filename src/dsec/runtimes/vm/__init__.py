"""The ``vm`` tier: full QEMU machines (q35) with a writable qcow2 disk and a display."""

from dsec.runtimes.vm.runtime import VMRuntime

__all__ = ["VMRuntime"]
