"""Backends for agent harnesses, built on dsec's public SDK (``pip install 'dsec[integrations]'``).

One module per harness; each imports its harness only when imported itself:

* :mod:`dsec.integrations.swerex` — SWE-ReX: ``DsecDeployment`` (an ``AbstractDeployment``)
  and its ``DsecRuntime`` (persistent shell sessions over exec, no server in the sandbox);
* :mod:`dsec.integrations.minisweagent` — mini-swe-agent: ``DsecEnvironment``, for
  ``environment_class: dsec.integrations.minisweagent.DsecEnvironment``;
* :mod:`dsec.integrations.harbor` — Harbor (Terminal-Bench): ``DsecEnvironment``;
* :mod:`dsec.integrations.inspect` — inspect_ai: the sandbox provider ``dsec``
  (``sandbox="dsec"``; the package's ``inspect_ai`` entry point imports it).

Tools that shell out to ``docker`` can use ``dsec docker`` / ``dsec-docker`` instead
(:mod:`dsec.cli.docker`). Commands for each harness: ``docs/integrations.md``.
"""
