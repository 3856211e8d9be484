"""inspect_ai sandbox provider ``dsec``: inspect's tasks run their tools in dsec sandboxes.

Installed with ``pip install 'dsec[integrations]'`` (inspect_ai 0.3.285, as tested): the
``inspect_ai`` entry point of the ``dsec`` package imports this module, which registers
the provider, so a task only names it::

    from inspect_ai import Task, task
    from inspect_ai.tool import bash, python

    @task
    def ctf() -> Task:
        return Task(dataset=..., solver=basic_agent(tools=[bash(), python()]),
                    sandbox=("dsec", "dsec.yaml"))   # or "dsec", or a DsecSandboxConfig

    # inspect eval ctf.py --model ...        (or --sandbox dsec on any task)

Glossary:

* a *config* (:class:`DsecSandboxConfig`, a YAML/JSON file of one, or a Dockerfile) says
  which sandboxes each sample gets: image, tier, sizes, network policy, environment,
  working directory, several named ones (:mod:`._config`);
* a *run* is one eval batch (inspect's sandbox lifecycle scope): one client per server,
  the sandboxes it made, the images it built (:mod:`._lifecycle`);
* an *environment* (:class:`DsecSandboxEnvironment`) is one sandbox of a sample: inspect's
  ``exec``, ``read_file``, ``write_file``, ``connection`` over dsec's APIs
  (:mod:`._environment`, whose docstring gives the semantics).

Lifecycle: ``task_init`` checks the server, the tiers and builds the Dockerfiles;
``sample_init`` creates the sample's sandboxes; ``sample_cleanup`` kills them (also after
an interruption); ``task_cleanup`` kills what the run still has; ``inspect sandbox cleanup
dsec [RUN|ID]`` (``cli_cleanup``) kills what an eval that died left, among the sandboxes of
the caller's key only. The server and key come from ``DSEC_URL`` and ``DSEC_API_KEY``
(or ``$DSEC_HOME/api_key``), as for the SDK. The provider needs inspect's asyncio
backend (the SDK is asyncio).
"""

from dsec.integrations.inspect._config import DsecSandboxConfig, DsecSandboxSpec
from dsec.integrations.inspect._environment import DsecSandboxEnvironment

__all__ = ["DsecSandboxConfig", "DsecSandboxEnvironment", "DsecSandboxSpec"]
