"""Harbor (``harbor[e2b]`` 0.25, the Terminal-Bench harness) against a real ``dsec serve``.

Harbor needs Python >= 3.12, so it lives in a venv of its own (``.venv-harbor`` at the
repository root, made by ``scripts/bootstrap.sh`` where such a Python exists; or
``DSEC_HARBOR_PYTHON``): each test runs Harbor's CLI (or a check script) with that Python
as a subprocess, pointed at a ``BackgroundServer`` of this process.

A local Terminal-Bench-format task (``task.toml``, ``instruction.md``,
``environment/Dockerfile``, ``solution/solve.sh``, ``tests/test.sh`` writing the reward) is
solved by Harbor's ``oracle`` agent to reward 1.0 through Harbor's own ``--env e2b`` (the
unmodified e2b SDK on dsec's E2B API: templates, sandboxes, envd) and through
``--env dsec.integrations.harbor:DsecEnvironment`` (8 trials at once, one build and one
snapshot reused by the others). A task whose Dockerfile does not build: the trial's error
names the failing step, and nothing keeps running.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import _seed_layers
from tests.integration.test_image_refs_root import _busybox_tar, _image
from tests.integration.test_oci_pull_root import DistributionRegistry, OciRepo
from tests.isolation import worker_subnet

from dsec.models import ListSandboxesRequest

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUBNET = worker_subnet(237)  # not the other tests' subnets
DSEC_ENV = "dsec.integrations.harbor:DsecEnvironment"


def harbor_python() -> Path:
    """The Python of the Harbor venv, or a skip saying why there is none."""
    given = os.environ.get("DSEC_HARBOR_PYTHON")
    exe = Path(given) if given else ROOT / ".venv-harbor" / "bin" / "python"
    if not exe.exists():
        pytest.skip(
            f"no Harbor venv at {exe}: Harbor needs Python >= 3.12 and scripts/bootstrap.sh "
            "makes .venv-harbor only where one exists (Debian 13's python3, or pyenv's "
            "3.12/3.13; Debian 12 ships 3.11 and PyPI has no standalone CPython)"
        )
    probe = subprocess.run(
        [str(exe), "-c", "import harbor, e2b, sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip(f"{exe} cannot import harbor and e2b: {probe.stderr.strip()[-300:]}")
    return exe


def write_task(root: Path, dockerfile: str) -> Path:
    """A Terminal-Bench-format task: the oracle's solve.sh sums numbers the image holds."""
    (root / "environment").mkdir(parents=True)
    (root / "solution").mkdir()
    (root / "tests").mkdir()
    (root / "task.toml").write_text(
        'schema_version = "1.4"\n\n[metadata]\ndifficulty = "easy"\n\n'
        "[verifier]\ntimeout_sec = 120.0\n\n[agent]\ntimeout_sec = 120.0\n\n"
        "[environment]\nbuild_timeout_sec = 300.0\ncpus = 1\nmemory_mb = 256\n"
    )
    (root / "instruction.md").write_text(
        "Write the sum of the numbers in /app/numbers.txt to /app/answer.txt.\n"
    )
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    (root / "solution" / "solve.sh").write_text(
        "#!/bin/sh\nset -e\ntotal=0\n"
        "while read -r n; do total=$((total + n)); done < /app/numbers.txt\n"
        'echo "$total" > /app/answer.txt\n'
    )
    (root / "tests" / "test.sh").write_text(
        "#!/bin/sh\nmkdir -p /logs/verifier\n"
        'if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n"
    )
    for p in (root / "solution" / "solve.sh", root / "tests" / "test.sh"):
        p.chmod(0o755)
    return root


def good_dockerfile(registry: DistributionRegistry) -> str:
    """The task's environment: FROM an image of the loopback registry (whose
    ``/etc/numbers.txt`` the task's RUN step copies)."""
    return (
        f"FROM {registry.host}/tb/base:1\nWORKDIR /app\nRUN cp /etc/numbers.txt /app/numbers.txt\n"
    )


class Server:
    def __init__(self, bg: Any, python: Path) -> None:
        self.bg = bg
        self.python = python

    def owner(self) -> str:
        return self.bg.keys.verify(self.bg.api_key)

    def env(self) -> dict[str, str]:
        url = self.bg.url
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "DSEC_URL": url,
            "DSEC_API_KEY": self.bg.api_key,
            "E2B_API_URL": f"{url}/e2b",
            "E2B_SANDBOX_URL": f"{url}/e2b/envd",
            "E2B_API_KEY": self.bg.api_key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # Harbor's litellm: no fetch from outside
            "NO_COLOR": "1",
        }

    def harbor(self, task: Path, jobs: Path, env_arg: str, *more: str) -> list[dict[str, Any]]:
        """``harbor run`` of ``task`` with the oracle agent; the trials' result.json."""
        harbor = self.python.parent / "harbor"
        cmd = [str(harbor), "run", "-p", str(task), "-a", "oracle", "-e", env_arg]
        cmd += ["-o", str(jobs), "-y", "-q", *more]
        r = subprocess.run(
            cmd, env=self.env(), cwd=jobs.parent, capture_output=True, text=True, timeout=900
        )
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        trials = [
            json.loads(p.read_text())
            for p in jobs.rglob("result.json")
            if p.parent.parent.parent == jobs
        ]
        assert trials, (r.stdout[-3000:], r.stderr[-3000:])
        return trials

    def sandboxes(self, label_value: str) -> list[Any]:
        assert self.bg.edge is not None
        req = ListSandboxesRequest(include_stopped=True)
        infos = self.bg.call(self.bg.edge.list_sandboxes(req, self.owner())).sandboxes
        return [i for i in infos if i.labels.get("harbor.environment") == label_value]

    def live(self) -> list[Any]:
        assert self.bg.edge is not None
        return self.bg.call(
            self.bg.edge.list_sandboxes(ListSandboxesRequest(), self.owner())
        ).sandboxes


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistributionRegistry]:
    """Debian's docker-registry on loopback with ``tb/base:1``: busybox and a data file."""
    if shutil.which("docker-registry") is None:
        pytest.skip("needs docker-registry (apt-get install docker-registry)")
    home = tmp_path_factory.mktemp("harbor-registry")
    reg = DistributionRegistry(home)
    try:
        repo = OciRepo()
        tar = _busybox_tar(home, {"/etc/numbers.txt": b"1\n2\n39\n"})
        _image(repo, tar, "1", {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]})
        reg.push("tb/base", repo)
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def server(
    dsec_home_root: Path, shared_layers: Path, registry: DistributionRegistry
) -> Iterator[Server]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    python = harbor_python()
    from dsec.server import BackgroundServer

    home = dsec_home_root / "harbor"
    _seed_layers(home, shared_layers)
    with BackgroundServer(home, tiers=["container"], network_options={"subnet": SUBNET}) as bg:
        assert bg.edge is not None
        if "container" not in bg.edge.runtimes:
            pytest.skip("the container tier is not available on this node")
        bg.call(bg.edge.layers.ensure_image("busybox"))
        yield Server(bg, python)
    shutil.rmtree(home, ignore_errors=True)


def rewards(trials: list[dict[str, Any]]) -> list[float | None]:
    out = []
    for t in trials:
        vr = t.get("verifier_result") or {}
        out.append((vr.get("rewards") or {}).get("reward"))
    return out


def errors(trials: list[dict[str, Any]]) -> list[str]:
    return [
        f"{(t.get('exception_info') or {}).get('exception_type')}: "
        f"{(t.get('exception_info') or {}).get('exception_message')}"
        for t in trials
        if t.get("exception_info")
    ]


def test_harbor_e2b_environment_solves_the_task(
    server: Server, registry: DistributionRegistry, tmp_path: Path
) -> None:
    task = write_task(tmp_path / "sum-task", good_dockerfile(registry))
    trials = server.harbor(task, tmp_path / "jobs", "e2b")
    assert rewards(trials) == [1.0], errors(trials)
    assert server.live() == []  # Harbor killed its sandbox


def test_harbor_dsec_environment_8_concurrent_trials_one_build(
    server: Server, registry: DistributionRegistry, tmp_path: Path
) -> None:
    task = write_task(tmp_path / "sum-dsec", good_dockerfile(registry))
    trials = server.harbor(task, tmp_path / "jobs", DSEC_ENV, "-k", "8", "-n", "8")
    assert rewards(trials) == [1.0] * 8, errors(trials)
    made = server.sandboxes("sum-dsec")
    assert len(made) == 8
    # the first trial built and set up the environment and snapshotted it; the other seven
    # started from the image plus that snapshot (one layer on top)
    fresh = [s for s in made if not s.layers]
    reused = [s for s in made if len(s.layers) == 1]
    assert len(fresh) == 1 and len(reused) == 7, [s.layers for s in made]
    assert len({s.layers[0] for s in reused}) == 1
    assert server.live() == []


def test_harbor_dsec_environment_api(
    server: Server, registry: DistributionRegistry, tmp_path: Path
) -> None:
    task = write_task(tmp_path / "checks", good_dockerfile(registry))
    r = subprocess.run(
        [
            str(server.python),
            str(ROOT / "tests/integrations/harbor_env_checks.py"),
            str(task),
            str(tmp_path),
        ],
        env=server.env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout[-3000:], r.stderr[-3000:])
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["capabilities"]["disable_internet"] and got["capabilities"]["dynamic_network_policy"]
    assert got["exec"] == [0, "/tmp\nfrom-env\nroot\n"]
    assert got["user"] == "nobody\n"
    assert got["exit"] == 7
    assert "timed out" in got["timeout"]
    assert got["uploaded"] == "deeptoptop"
    assert got["downloaded"] == ["a", "sub/b", "top"]
    assert got["is_dir"] == [True, False] and got["is_file"] == [True, False]
    assert got["no_network"].strip() != "0"  # no-network: nothing reachable
    assert server.live() == []


@pytest.mark.parametrize(
    ("dockerfile", "words"),
    [
        (
            "FROM busybox\nRUN echo preparing; echo broken-step >&2; exit 4\n",
            ["exit code 4", "broken-step"],
        ),
        ("FROM busybox\nHEALTHCHECK CMD true\n", ["line 2", "HEALTHCHECK"]),
    ],
)
def test_a_task_that_does_not_build(
    server: Server, tmp_path: Path, dockerfile: str, words: list[str]
) -> None:
    task = write_task(tmp_path / "broken", dockerfile)
    trials = server.harbor(task, tmp_path / "jobs", DSEC_ENV)
    errs = errors(trials)
    assert len(errs) == 1 and "SandboxBuildFailedError" in errs[0], errs
    for w in words:
        assert w in errs[0], errs
    assert server.live() == []  # nothing keeps running


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
