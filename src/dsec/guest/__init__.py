"""The guest side of the ``microvm`` and ``vm`` tiers: guest agent (agent.c), init script
(init.sh), and the builder of kernel + initramfs (:mod:`dsec.guest.build`)."""

from dsec.guest.build import GuestArtifacts, ensure_guest_artifacts, host_tsc_khz

__all__ = ["GuestArtifacts", "ensure_guest_artifacts", "host_tsc_khz"]
