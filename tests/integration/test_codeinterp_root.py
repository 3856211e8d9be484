"""The ``code-interpreter`` image built as a built-in, its server started by the image's
start command when a real container sandbox is created (the creation returns once
``/health`` answers), and driven from inside the sandbox over its loopback (E2B's wire
format, as the port proxy relays it), then from outside by the unmodified
e2b-code-interpreter and smolagents clients through the node's E2B API and port proxy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec import Sandbox
from dsec.layers import code_interpreter as ci
from dsec.models import SandboxRef
from dsec.server import BackgroundServer

# the first run builds the image (apt from the node's Debian mirror: minutes on a busy node)
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.debian, pytest.mark.timeout(1800)]

# Runs inside the sandbox under the image's python3: waits for /health, then speaks the
# wire format e2b-code-interpreter speaks (POST /execute, NDJSON lines; /contexts).
CLIENT = r"""
import json, sys, time, urllib.request, urllib.error
BASE = "http://127.0.0.1:PORT"
def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          "E2b-Sandbox-Port": "PORT"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()
def execute(**body):
    return [json.loads(line) for line in call("POST", "/execute", body).splitlines() if line]
deadline = time.time() + 90
while True:
    try:
        if call("GET", "/health") == '"OK"':
            break
    except (urllib.error.URLError, ConnectionError):
        pass
    if time.time() > deadline:
        sys.exit("the server did not get ready")
    time.sleep(0.2)
out = {}
execute(code="x = 41")
out["state"] = execute(code="x + 1")
out["chart"] = execute(code="import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
out["error"] = execute(code="1 / 0")
out["env"] = execute(code="import os\nos.environ['CI_VAR']", env_vars={"CI_VAR": "in-sandbox"})
out["cwd"] = execute(code="import os\nos.getcwd()")
out["bash"] = execute(code="echo $((6 * 7))", language="bash")
out["js"] = execute(code="[1, 2, 3].map(v => v * 2)", language="javascript")
ctx = json.loads(call("POST", "/contexts", {"language": "python", "cwd": "/tmp"}))
out["context"] = ctx
out["in_context"] = execute(code="import os\nos.getcwd()", context_id=ctx["id"])
out["contexts"] = json.loads(call("GET", "/contexts"))
call("DELETE", "/contexts/" + ctx["id"])
out["after_remove"] = json.loads(call("GET", "/contexts"))
print(json.dumps(out))
""".replace("PORT", str(ci.PORT))


def _of(lines: list[dict[str, object]], kind: str) -> list[dict[str, object]]:
    return [line for line in lines if line["type"] == kind]


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, shared_layers: Path
) -> Iterator[BackgroundServer]:
    home = tmp_path_factory.mktemp("codeinterp-root") / "home"
    home.mkdir()
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    with BackgroundServer(home, tiers=["container"]) as srv:
        assert srv.edge is not None and srv.loop is not None
        image = asyncio.run_coroutine_threadsafe(
            srv.edge.layers.ensure_image(ci.IMAGE_NAME), srv.loop
        ).result(3600)
        assert image.meta["start"]["cmd"] == list(ci.START_CMD)
        yield srv


def test_code_interpreter_image_serves_e2b_api_in_a_sandbox(node: BackgroundServer) -> None:
    with Sandbox.create(
        tier="container",
        image=ci.IMAGE_NAME,
        memory_mb=1024,
        ttl_s=600,
        url=node.url,
        api_key=node.api_key,
    ) as sb:
        assert sb.info.workdir == ci.WORKDIR  # the image's config
        r = sb.commands.run(["python3", "-c", CLIENT], timeout=180)
        log = "".join(line.data for line in sb.logs())  # the start command's output
        assert r.ok, f"{r.stdout}\n{r.stderr}\nserver log:\n{log}"
        out = json.loads(r.stdout)

    assert _of(out["state"], "result")[0]["text"] == "42"
    assert _of(out["state"], "number_of_executions")[0]["execution_count"] == 2
    assert out["state"][-1] == {"type": "end_of_execution"}
    pngs = [x for x in _of(out["chart"], "result") if "png" in x]
    assert pngs and pngs[0]["chart"]["type"] == "line"
    err = _of(out["error"], "error")[0]
    assert err["name"] == "ZeroDivisionError" and "1 / 0" in str(err["traceback"])
    assert _of(out["env"], "result")[0]["text"] == "in-sandbox"
    assert _of(out["cwd"], "result")[0]["text"] == ci.WORKDIR
    assert _of(out["bash"], "stdout")[0]["text"] == "42\n"
    assert _of(out["js"], "result")[0]["text"] == "[ 2, 4, 6 ]"
    assert out["context"]["cwd"] == "/tmp"
    assert _of(out["in_context"], "result")[0]["text"] == "/tmp"
    languages = {c["language"] for c in out["contexts"]}
    assert {"python", "bash", "javascript"} <= languages
    assert out["context"]["id"] not in [c["id"] for c in out["after_remove"]]


@pytest.fixture
def e2b_env(node: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B_* pointing the unmodified SDKs at the node's E2B API, as a user would."""
    monkeypatch.setenv("E2B_API_URL", f"{node.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{node.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", node.api_key)


def test_e2b_code_interpreter_through_the_port_proxy(e2b_env: None, node: BackgroundServer) -> None:
    """The unmodified e2b-code-interpreter client: its requests to port 49999 carry
    ``E2b-Sandbox-Port`` and reach the kernel server in a real sandbox through the port
    proxy (state, a chart, an exception, a timeout that interrupts the kernel)."""
    from e2b.exceptions import TimeoutException
    from e2b_code_interpreter import Sandbox as CodeInterpreter

    with CodeInterpreter.create(timeout=600) as sbx:
        assert sbx.run_code("x = 41").error is None
        assert sbx.run_code("x + 1").text == "42"
        chart = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
        assert chart.results and chart.results[0].png, chart
        assert chart.results[0].chart is not None
        err = sbx.run_code("1 / 0").error
        assert err is not None and err.name == "ZeroDivisionError"
        with pytest.raises(TimeoutException):
            sbx.run_code("import time\ntime.sleep(60)", timeout=3)
        assert sbx.run_code("x").text == "41"  # the kernel was interrupted, not lost
        # the sandbox is a dsec sandbox of this key, made from the code-interpreter image
        info = node.call(node.edge.get_sandbox(SandboxRef(sandbox_id=sbx.sandbox_id), _owner(node)))  # type: ignore[union-attr]
        assert info.image == ci.IMAGE_NAME


def test_smolagents_e2b_executor_on_a_dsec_sandbox(e2b_env: None) -> None:
    """smolagents' E2BExecutor (unmodified) runs an agent's code on a dsec sandbox."""
    from smolagents.default_tools import FinalAnswerTool
    from smolagents.monitoring import AgentLogger, LogLevel
    from smolagents.remote_executors import E2BExecutor
    from smolagents.utils import AgentError

    executor = E2BExecutor(additional_imports=[], logger=AgentLogger(level=LogLevel.OFF))
    try:
        out = executor("x_smol = 20\nprint('working')\nx_smol + 22")
        assert out.output == "42" and "working" in out.logs
        with pytest.raises(AgentError, match="ZeroDivisionError"):
            executor("1 / 0")
        image = executor(
            "import matplotlib.pyplot as plt\nfig = plt.figure()\nplt.plot([1, 2])\nfig"
        )
        assert image.output is not None and image.output.format == "PNG"
        executor.send_tools({"final_answer": FinalAnswerTool()})
        final = executor("final_answer({'answer': x_smol * 2})")
        assert final.is_final_answer and final.output == {"answer": 40}
    finally:
        executor.cleanup()


def _owner(node: BackgroundServer) -> str:
    from dsec.apiserver.auth import owner_id

    return owner_id(node.api_key)


def test_e2b_default_user_and_pip(e2b_env: None, node: BackgroundServer) -> None:
    """E2B's template: a command without ``user=`` runs as ``user`` in ``/home/user``, as
    does the kernel server; ``pip`` is there. dsec's own API gives the image's user too (the
    image is E2B-shaped), and stays root on ``debian`` (its default unchanged)."""
    from e2b_code_interpreter import Sandbox as CodeInterpreter

    with CodeInterpreter.create(timeout=600) as sbx:
        r = sbx.commands.run("id -un; echo $HOME; pwd; command -v pip; sudo -n id -un")
        assert r.stdout.split() == ["user", "/home/user", "/home/user", "/usr/bin/pip", "root"]
        assert sbx.commands.run("id -un", user="root").stdout == "root\n"
        assert sbx.run_code("import getpass\ngetpass.getuser()").text == "user"
        sb = Sandbox.connect(sbx.sandbox_id, url=node.url, api_key=node.api_key)
        assert sb.commands.run("id -un").stdout == "user\n"
    with Sandbox.create(
        tier="container", image="debian", ttl_s=300, url=node.url, api_key=node.api_key
    ) as sb:
        assert sb.commands.run("id -un").stdout == "root\n"


def _wheel(dest: Path, name: str, version: str, module_text: str) -> Path:
    """A pure-Python wheel of one module, ``name`` (what pip installs from a local index)."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": module_text,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: dsec-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }

    def digest(text: str) -> str:
        raw = hashlib.sha256(text.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    record = "".join(f"{p},{digest(t)},{len(t.encode())}\n" for p, t in files.items())
    files[f"{dist}/RECORD"] = record + f"{dist}/RECORD,,\n"
    path = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
    return path


def test_smolagents_installs_an_extra_authorized_import(
    e2b_env: None, node: BackgroundServer, tmp_path: Path
) -> None:
    """smolagents' CodeAgent on E2B with ``additional_authorized_imports``: its executor
    runs ``!pip install <import>`` in the sandbox (E2B's code-interpreter has pip), from
    the index pip is configured with: here a local one, a directory of wheels baked into an
    image of the key (``PIP_FIND_LINKS``, ``PIP_NO_INDEX``: no network), then the agent's
    code imports it. Another key cannot use that image or reach the sandbox."""
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import Sandbox as CodeInterpreter
    from smolagents import CodeAgent
    from smolagents.models import ChatMessage, MessageRole, Model

    from dsec import Client, Image

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "dsec_probe", "1.0", "def answer():\n    return 6 * 7\n")
    image = (
        Image.from_image(ci.IMAGE_NAME)
        .copy(wheels, "/opt/wheels/")
        .env(PIP_FIND_LINKS="/opt/wheels", PIP_NO_INDEX="1")
    )
    with Client(node.url, node.api_key) as client:
        image.build("ci-wheels:1", client=client)

    class Scripted(Model):
        """The model: one action that imports the package and answers."""

        def generate(self, messages: Any, **kwargs: Any) -> ChatMessage:
            code = "import dsec_probe\nfinal_answer(dsec_probe.answer())"
            return ChatMessage(
                role=MessageRole.ASSISTANT, content=f"Thought: use it.\n<code>\n{code}\n</code>"
            )

    agent = CodeAgent(
        tools=[],
        model=Scripted(),
        executor_type="e2b",
        executor_kwargs={"template": "ci-wheels:1", "timeout": 600},
        additional_authorized_imports=["dsec_probe"],
        verbosity_level=0,
    )
    try:
        sandbox = agent.python_executor.sandbox  # type: ignore[attr-defined]
        assert sandbox.commands.run("pip show dsec_probe").stdout.startswith("Name: dsec_probe")
        assert agent.run("What does dsec_probe answer?") == 42
        # a second key: the image is not its to use, the sandbox not its to see
        other = node.keys.create_key("codeinterp-other")
        with pytest.raises(SandboxException, match="template not found"):
            CodeInterpreter.create(template="ci-wheels:1", api_key=other)
        r = httpx.get(
            f"{node.url}/v1/sandboxes/{sandbox.sandbox_id}",
            headers={"authorization": f"Bearer {other}"},
        )
        assert r.status_code == 404
    finally:
        agent.cleanup()
