"""The contract at the bottom: what the tiers, the edge and the guest share, and nothing that
implements them. Nothing in this package imports a tier, the edge or the server.

* :mod:`dsec.contract.edge`: what an edge (one node's agent) answers, verb by verb, and
  its optional abilities: what the apiserver, the cluster relay and the E2B layer call.
* :mod:`dsec.contract.runtime`: what a tier's runtime implements (the base every tier
  subclasses, its handle and its optional abilities): what the edge calls.
* :mod:`dsec.contract.isolation`: the isolation policy (seccomp rules, capabilities,
  rlimits, masked and read-only paths) every tier that runs Linux processes enforces.
* :mod:`dsec.contract.streams`: the streams a runtime hands up through the edge (a
  process's output and terminal, a watched directory's events, a TCP connection).
"""
