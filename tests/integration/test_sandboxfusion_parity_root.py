"""SandboxFusion parity through raw ``/run_code`` and ``/run_jupyter`` requests to a full
``dsec serve`` (fncall and container tiers): absolute ``fetch_files``, Java as SandboxFusion
runs it (``-ea``, javatuples and the call's jars, a clean stderr), rust, SandboxFusion's npm
and PyPI packages, local servers inside a call (its isolation tests), and Jupyter cells on a
real kernel. Each test states the SandboxFusion test it mirrors.

The layer cache is ``$DSEC_TEST_LAYER_CACHE`` (default the shared one): the first run builds
the toolkit layers (rust, java, nodejs, python-runtime) and the code-interpreter image.
"""

from __future__ import annotations

import base64
import io
import json
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsec.server import BackgroundServer

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.debian,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, shared_layers: Path
) -> Iterator[BackgroundServer]:
    home = tmp_path_factory.mktemp("sf-parity") / "home"
    home.mkdir()
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    with BackgroundServer(home, tiers=["fncall", "container"]) as srv:
        yield srv


def _post(node: BackgroundServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(
        node.url + route,
        json=body,
        headers={"Authorization": f"Bearer {node.api_key}"},
        timeout=1800,  # the first call of a language builds its toolkit layer
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def run_code(node: BackgroundServer, **body: Any) -> dict[str, Any]:
    return _post(node, "/run_code", body)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- fetch_files ------------------------------------------------------------------------


def test_fetch_files_outside_work(node: BackgroundServer) -> None:
    """SandboxFusion test_python_fetch_files: ``/mnt/b`` is written and fetched by its
    absolute path; ``/tmp`` too; files of ``/proc`` (the agent's own) are not fetched."""
    res = run_code(
        node,
        language="python",
        code=(
            'open("a.txt", "w").write("secret"); open("/mnt/b", "w").write("sauce")\n'
            'open("/tmp/c", "w").write("tmp")\n'
        ),
        fetch_files=["a.txt", "/mnt/b", "/tmp//c", "/proc/version", "/mnt/missing"],
    )
    assert res["status"] == "Success", res
    assert base64.b64decode(res["files"]["a.txt"]) == b"secret"
    assert base64.b64decode(res["files"]["/mnt/b"]) == b"sauce"
    assert base64.b64decode(res["files"]["/tmp//c"]) == b"tmp"  # keyed as asked
    assert "/proc/version" not in res["files"]
    assert "fetch /proc/version: files of /proc are not fetched" in res["message"]
    assert "fetch /mnt/missing: No such file or directory" in res["message"]


def test_fetch_files_refuses_dotdot(node: BackgroundServer) -> None:
    res = run_code(node, language="python", code="pass", fetch_files=["/mnt/../etc/passwd"])
    assert res["status"] == "SandboxError" and "'..'" in res["message"]


def test_mnt_is_private_per_call(node: BackgroundServer) -> None:
    first = run_code(node, language="python", code='open("/mnt/left", "w").write("x")')
    assert first["status"] == "Success", first  # /mnt is writable, as in SandboxFusion
    res = run_code(node, language="python", code='import os; print(os.path.exists("/mnt/left"))')
    assert res["run_result"]["stdout"] == "False\n"


# --- java -----------------------------------------------------------------------------

JAVA_MAIN = """
public class Main {
    public static void main(String[] args) {
        %s
    }
}
"""


def test_java_assert_enabled_and_clean_stderr(node: BackgroundServer) -> None:
    """SandboxFusion test_java_assert (``assert 1 == 2`` fails: ``-ea``) and a stderr that
    holds only the program's output (no "Picked up JAVA_TOOL_OPTIONS")."""
    res = run_code(node, language="java", code=JAVA_MAIN % "assert 1 == 2;")
    assert res["status"] == "Failed", res
    assert res["run_result"]["status"] == "Finished"
    assert "java.lang.AssertionError" in res["run_result"]["stderr"]
    ok = run_code(node, language="java", code=JAVA_MAIN % 'System.err.print("only this");')
    assert ok["status"] == "Success", ok
    assert ok["run_result"]["stderr"] == "only this"
    assert ok["compile_result"]["stderr"] == ""


def test_java_javatuples_and_the_calls_jars(node: BackgroundServer) -> None:
    """SandboxFusion test_java_external_jar (javatuples) and its ``*.jar`` files on the
    class path: a jar built from a first call's class file is used by a second call."""
    res = run_code(
        node,
        language="java",
        code=(
            "import org.javatuples.Pair;\n"
            + JAVA_MAIN % 'System.out.println(Pair.with("apple", 1).getValue0());'
            + "\nclass Lib { public static int answer() { return 42; } }\n"
        ),
        fetch_files=["Lib.class"],
    )
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == "apple\n"
    jar = io.BytesIO()
    with zipfile.ZipFile(jar, "w") as z:
        z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
        z.writestr("Lib.class", base64.b64decode(res["files"]["Lib.class"]))
    res = run_code(
        node,
        language="java",
        code=JAVA_MAIN % "System.out.println(Lib.answer());",
        files={"deps/lib.jar": _b64(jar.getvalue())},
    )
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == "42\n"


# --- rust -----------------------------------------------------------------------------


def test_rust(node: BackgroundServer) -> None:
    """SandboxFusion test_rust: print with stdin, assertion, compile error."""
    res = run_code(
        node,
        language="rust",
        code=(
            "use std::io;\nfn main() {\n let mut s = String::new();\n"
            " io::stdin().read_line(&mut s).unwrap();\n let n: i32 = s.trim().parse().unwrap();\n"
            ' println!("{}", n + 1);\n}\n'
        ),
        stdin="41",
    )
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == "42\n"
    res = run_code(node, language="rust", code="fn main() { assert_eq!(1, 2); }")
    assert res["status"] == "Failed" and "assertion" in res["run_result"]["stderr"]
    res = run_code(node, language="rust", code='fn main() { let x: u32 = "a"; }')
    assert res["status"] == "Failed" and res["run_result"] is None
    assert res["compile_result"]["return_code"] != 0


# --- nodejs ---------------------------------------------------------------------------


def test_nodejs_preinstalled_packages(node: BackgroundServer) -> None:
    """SandboxFusion test_nodejs_lodash_dep, and the other packages of its package.json."""
    res = run_code(
        node,
        language="nodejs",
        code=(
            'const _ = require("lodash"); const md5 = require("js-md5");\n'
            'const seedrandom = require("seedrandom"); const { JSDOM } = require("jsdom");\n'
            "const dom = new JSDOM('<p id=x>hi</p>');\n"
            'console.log(_.chunk([1, 2, 3], 2).length, md5(""),\n'
            '  seedrandom("s")() === seedrandom("s")(), dom.window.document.getElementById("x").textContent);'
        ),
    )
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == "2 d41d8cd98f00b204e9800998ecf8427e true hi\n"


# --- python ---------------------------------------------------------------------------


def test_python_preinstalled_libraries(node: BackgroundServer) -> None:
    """SandboxFusion's runtime requirements, at its versions."""
    res = run_code(
        node,
        language="python",
        code=(
            "import requests, numpy, pandas, scipy, sklearn, matplotlib, bs4, lxml, flask\n"
            "matplotlib.use('Agg'); import matplotlib.pyplot as plt\n"
            "plt.plot([1, 2]); plt.savefig('/tmp/p.png')\n"
            "print(requests.__version__, numpy.__version__, pandas.__version__,"
            " scipy.__version__, sklearn.__version__, matplotlib.__version__)\n"
            "print(int(numpy.arange(10).sum()), pandas.DataFrame({'a': [1, 2]}).a.sum())\n"
        ),
    )
    assert res["status"] == "Success", res
    lines = res["run_result"]["stdout"].splitlines()
    assert lines == ["2.31.0 1.26.3 2.2.0 1.11.4 1.4.0 3.8.2", "45 3"]


def test_python_local_server_and_requests(node: BackgroundServer) -> None:
    """SandboxFusion test_isolation_network_server_127/localhost: a server inside the call,
    reached with ``requests`` on 127.0.0.1 and localhost."""
    code = """
import http.server, socketserver, threading, requests
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"special string")
    def log_message(self, *a): pass
srv = socketserver.TCPServer(("", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
port = srv.server_address[1]
print(requests.get(f"http://127.0.0.1:{port}").text, requests.get(f"http://localhost:{port}").text)
"""
    res = run_code(node, language="python", code=code, run_timeout=10)
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == "special string special string\n"


# --- jupyter --------------------------------------------------------------------------


def run_jupyter(node: BackgroundServer, **body: Any) -> dict[str, Any]:
    return _post(node, "/run_jupyter", body)


def test_jupyter_cells_share_a_kernel(node: BackgroundServer) -> None:
    """SandboxFusion test_jupyter_multi_cell(_raise): state across cells, the value's MIME
    bundle as the kernel sent it, stderr, an error that does not stop the next cells."""
    res = run_jupyter(
        node,
        cells=[
            'a = "hello"',
            "a",
            'import sys\nsys.stderr.write("This is an error message\\n")',
            "assert False",
            "print(a)",
        ],
    )
    assert res["status"] == "Success", res
    cells = res["cells"]
    assert cells[0] == {"stdout": "", "stderr": "", "display": [], "error": []}
    assert cells[1]["display"][0]["text/plain"] == "'hello'"
    assert cells[2]["stderr"] == "This is an error message\n"
    assert cells[3]["error"][0]["ename"] == "AssertionError"
    assert cells[4]["stdout"] == "hello\n"
    assert res["driver"]["status"] == "Finished"


def test_jupyter_plot_files_and_cleanup(node: BackgroundServer) -> None:
    """SandboxFusion test_jupyter_plot (an ``image/png`` display), ``files`` and
    ``fetch_files`` relative to the kernel's directory, SandboxFusion's Python libraries in
    the kernel, and no sandbox left behind."""
    res = run_jupyter(
        node,
        cells=[
            "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()",
            "open('out.txt', 'w').write(open('in/data.txt').read().upper())",
            "import requests, numpy\nprint(requests.__version__, numpy.__version__)",
        ],
        files={"in/data.txt": _b64(b"abc")},
        fetch_files=["out.txt"],
    )
    assert res["status"] == "Success", res
    assert "image/png" in res["cells"][0]["display"][0]
    assert base64.b64decode(res["files"]["out.txt"]) == b"ABC"
    # the python-runtime toolkit stacked on the kernel's image: SandboxFusion's pins
    assert res["cells"][2]["stdout"] == "2.31.0 1.26.3\n"
    left = httpx.get(
        node.url + "/v1/sandboxes", headers={"Authorization": f"Bearer {node.api_key}"}
    ).json()["sandboxes"]
    assert left == []  # the call's sandbox was killed


def test_jupyter_total_timeout_and_refusals(node: BackgroundServer) -> None:
    res = run_jupyter(node, cells=["import time; time.sleep(30)"], total_timeout=3)
    assert res["status"] == "Failed" and res["cells"] == []
    assert res["driver"]["status"] == "TimeLimitExceeded"
    res = run_jupyter(node, cells=["1"], kernel="ir")
    assert res["status"] == "SandboxError" and "python3" in res["message"]
    assert json.dumps(res)  # a SandboxFusion client parses it
