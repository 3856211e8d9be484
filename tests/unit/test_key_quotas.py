"""Per-key quotas (dsec.edge.quotas): set by the operator, stored with the keys, checked on
every creation, refused with a typed error naming the quota, shown only to the key itself."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from dsec import AsyncClient, AsyncSandbox, CreationRateExceeded, QuotaExceeded, TierUnavailable
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import KeyStore, owner_id
from dsec.cli import main as cli
from dsec.edge.quotas import (
    CODE_RUN_CPU,
    CODE_RUN_MEMORY_MB,
    UNLIMITED,
    QuotaGuard,
    code_run_size,
)
from dsec.models import CodeRunRequest, KeyQuota, KeyUsage, RunCodeRequest
from dsec.testing import FakeEdge


class _Quotas:
    def __init__(self, **per_owner: KeyQuota) -> None:
        self.per_owner = per_owner

    def quota_of(self, owner: str) -> KeyQuota:
        return self.per_owner.get(owner, UNLIMITED)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_each_limit_is_named_with_what_the_key_holds() -> None:
    guard = QuotaGuard(_Quotas(a=KeyQuota(max_sandboxes=3, max_cpu=2.0, max_memory_mb=1024)))
    held = KeyUsage(sandboxes=2, cpu=1.0, memory_mb=512)
    guard.check("a", held, cpu=1.0, memory_mb=512, count=1)  # exactly at every limit: fine
    cases: list[tuple[dict[str, Any], str]] = [
        ({"cpu": 0.5, "memory_mb": 128, "count": 2}, "max_sandboxes"),
        ({"cpu": 1.5, "memory_mb": 128, "count": 1}, "max_cpu"),
        ({"cpu": 0.5, "memory_mb": 1000, "count": 1}, "max_memory_mb"),
    ]
    for kw, quota in cases:
        with pytest.raises(QuotaExceeded) as e:
            guard.check("a", held, **kw)
        assert e.value.details["quota"] == quota
        assert quota in e.value.message and e.value.http_status == 429
    guard.check("b", KeyUsage(sandboxes=10_000), cpu=64, memory_mb=1 << 20, count=500)


def test_creations_in_flight_count_against_the_quota() -> None:
    guard = QuotaGuard(_Quotas(a=KeyQuota(max_sandboxes=2)))
    with guard.admitted("a", cpu=1, memory_mb=1, count=2):
        with pytest.raises(QuotaExceeded):
            guard.check("a", KeyUsage(), cpu=1, memory_mb=1)
    guard.check("a", KeyUsage(), cpu=1, memory_mb=1, count=2)


def test_the_rate_is_a_bucket_of_one_seconds_worth() -> None:
    clock = _Clock()
    guard = QuotaGuard(_Quotas(a=KeyQuota(creations_per_s=2)), clock=clock)
    guard.take("a")
    guard.take("a")
    with pytest.raises(CreationRateExceeded) as e:
        guard.take("a")
    assert e.value.details["retry_after_s"] == pytest.approx(0.5)
    assert e.value.details["quota"] == "creations_per_s"
    clock.t += 0.5
    guard.take("a")
    with pytest.raises(QuotaExceeded, match="smaller batches"):
        guard.take("a", 3)  # more than a second's worth can never pass
    for _ in range(100):
        guard.take("b")  # no rate quota


def test_room_admits_what_fits_and_names_the_rest() -> None:
    clock = _Clock()
    guard = QuotaGuard(_Quotas(a=KeyQuota(max_sandboxes=5, creations_per_s=3)), clock=clock)
    fits, refusal = guard.room("a", KeyUsage(sandboxes=1), cpu=1, memory_mb=1, want=10)
    assert fits == 3 and isinstance(refusal, CreationRateExceeded)
    clock.t += 10
    fits, refusal = guard.room("a", KeyUsage(sandboxes=4), cpu=1, memory_mb=1, want=3)
    assert fits == 1 and refusal is not None and refusal.details["quota"] == "max_sandboxes"
    assert guard.room("b", KeyUsage(), cpu=1, memory_mb=1, want=7) == (7, None)


def test_the_key_store_keeps_quotas_and_other_processes_see_changes(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    key = store.create_key("rl", quota=KeyQuota(max_sandboxes=10, cpu_weight=300))
    owner = owner_id(key)
    other = KeyStore(tmp_path)  # another process: the CLI beside a running server
    assert other.quota_of(owner) == KeyQuota(max_sandboxes=10, cpu_weight=300)
    stored = json.loads((tmp_path / "api_keys.json").read_text())["keys"][-1]
    assert stored["quota"] == {"max_sandboxes": 10, "cpu_weight": 300}  # only what is set
    store.set_quota(owner, KeyQuota(max_cpu=4))
    assert other.quota_of(owner) == KeyQuota(max_cpu=4)
    assert other.quota_of("k0000000000000000") == UNLIMITED
    with pytest.raises(KeyError):
        store.set_quota("k0000000000000000", KeyQuota())


async def _api(tmp_path: Path) -> tuple[FakeEdge, KeyStore, Any]:
    edge = FakeEdge()
    keys = KeyStore(tmp_path)
    return edge, keys, create_app(edge, keys)


def _client(app: Any, key: str) -> AsyncClient:
    return AsyncClient("http://dsec.test", key, transport=httpx.ASGITransport(app=app))


async def test_a_key_past_its_quota_is_refused_and_another_key_is_not(tmp_path: Path) -> None:
    edge, keys, app = await _api(tmp_path)
    a = keys.create_key("a", quota=KeyQuota(max_sandboxes=2, max_memory_mb=1024))
    b = keys.create_key("b")
    try:
        async with _client(app, a) as ca, _client(app, b) as cb:
            made = [await AsyncSandbox.create(client=ca, memory_mb=256) for _ in range(2)]
            with pytest.raises(QuotaExceeded) as e:
                await AsyncSandbox.create(client=ca, memory_mb=256)
            assert e.value.details["quota"] == "max_sandboxes"
            assert e.value.details["limit"] == 2 and e.value.details["used"] == 2
            # the other key is not limited by a's quota
            others = [await AsyncSandbox.create(client=cb) for _ in range(3)]
            # each key sees only itself
            info_a, info_b = await ca.key_info(), await cb.key_info()
            assert info_a.owner == owner_id(a) and info_b.owner == owner_id(b)
            assert info_a.quota.max_sandboxes == 2 and info_b.quota == UNLIMITED
            assert info_a.usage == KeyUsage(sandboxes=2, cpu=2.0, memory_mb=512)
            assert info_b.usage.sandboxes == 3
            # a batch takes what fits and names the quota for the rest
            await made[0].kill()
            r = await ca._http.request(
                "POST", "/v1/sandboxes/batch", json={"n": 3, "sandbox": {"memory_mb": 256}}
            )
            body = r.json()
            assert len(body["sandboxes"]) == 1
            assert [x["code"] for x in body["errors"]] == ["quota_exceeded"] * 2
            # memory: one more of 1024 MiB does not fit 1024 with 512 held
            await made[1].kill()
            with pytest.raises(QuotaExceeded) as e:
                await AsyncSandbox.create(client=ca, memory_mb=1024)
            assert e.value.details["quota"] == "max_memory_mb"
            # a fork counts its children
            keys.set_quota(owner_id(a), KeyQuota(max_sandboxes=2))
            base = await AsyncSandbox.connect(
                body["sandboxes"][0]["id"],
                url="http://dsec.test",
                api_key=a,
                transport=httpx.ASGITransport(app=app),
            )
            with pytest.raises(QuotaExceeded):
                await base.fork(n=2)
            for sb in others:
                await sb.kill()
    finally:
        await edge.close()


async def test_the_rate_quota_makes_the_sdk_wait_not_fail(tmp_path: Path) -> None:
    edge, keys, app = await _api(tmp_path)
    a = keys.create_key("a", quota=KeyQuota(creations_per_s=4))
    try:
        async with _client(app, a) as ca:
            t0 = time.monotonic()
            made = [await AsyncSandbox.create(client=ca) for _ in range(8)]
            # 4 at once, then 4 a second: the last one at least ~1 s later, and none failed
            assert time.monotonic() - t0 >= 0.9
            assert len({sb.id for sb in made}) == 8
            r = await ca._http.request("GET", "/v1/key")  # the raw answer, as documented
            assert r.json()["quota"]["creations_per_s"] == 4
    finally:
        await edge.close()


def test_operator_sets_quotas_from_the_command_line(tmp_path: Path) -> None:
    runner = CliRunner(env={"COLUMNS": "200"})
    home = ["--home", str(tmp_path)]
    made = runner.invoke(
        cli.app,
        ["key", "create", "--name", "rl", "--max-sandboxes", "100", "--max-cpu", "8", *home],
    )
    assert made.exit_code == 0, made.output
    owner = owner_id(made.stdout.strip())
    listed = json.loads(runner.invoke(cli.app, ["key", "ls", "-o", "json", *home]).stdout)
    quota = next(k["quota"] for k in listed if k["owner"] == owner)
    assert quota["max_sandboxes"] == 100 and quota["max_cpu"] == 8 and quota["cpu_weight"] == 100
    changed = runner.invoke(
        cli.app, ["key", "set", owner, "--max-sandboxes", "none", "--creations-per-s", "5", *home]
    )
    assert changed.exit_code == 0, changed.output
    assert KeyStore(tmp_path).quota_of(owner) == KeyQuota(max_cpu=8, creations_per_s=5)
    bad = runner.invoke(cli.app, ["key", "set", owner, "--max-cpu", "-1", *home])
    assert bad.exit_code == 1 and "--max-cpu" in bad.output
    missing = runner.invoke(cli.app, ["key", "set", "k0000000000000000", "--max-cpu", "1", *home])
    assert missing.exit_code == 1 and "no such key" in missing.output
    assert KeyStore(tmp_path).quota_of(owner) == KeyQuota(max_cpu=8, creations_per_s=5)


async def test_run_code_is_refused_by_the_key_quota_like_a_creation(tmp_path: Path) -> None:
    """``run_code`` (dsec's /v1/run_code and SandboxFusion's /run_code) goes through the
    edge's admission: a call the key's quota cannot hold is refused with the typed error,
    before any worker is claimed; SandboxFusion's route answers it with dsec's error and
    status (not a 200 ``SandboxError``); another key is not refused. The fncall tier under
    the edge is one that was never started: a call that passes admission ends there."""
    from dsec.config import Paths
    from dsec.runtimes.fncall.runtime import FncallRuntime
    from dsec.runtimes.fncall.service import RunCodeService
    from dsec.server import PortsSettings, build_app, close_app

    edge = FakeEdge()
    keys = KeyStore(tmp_path)
    edge.code_runner = RunCodeService(FncallRuntime(Paths(tmp_path / "node")))
    app = build_app(edge, keys, PortsSettings(home=tmp_path))
    full = keys.create_key("full", quota=KeyQuota(max_sandboxes=1))
    small = keys.create_key("small", quota=KeyQuota(max_memory_mb=512))
    slow = keys.create_key("slow", quota=KeyQuota(creations_per_s=0.001))  # one, then none
    free = keys.create_key("free")
    sf = {"code": "echo hi", "language": "bash"}
    try:
        async with _client(app, full) as cf, _client(app, small) as cs, _client(app, free) as c:
            held = await AsyncSandbox.create(client=cf, memory_mb=64)
            with pytest.raises(QuotaExceeded) as e:
                await cf.run_code("echo hi", "bash")
            assert e.value.details["quota"] == "max_sandboxes" and e.value.details["used"] == 1
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            async with http:
                for r in (
                    await http.post(f"/k/{full}/run_code", json=sf),
                    await http.post(
                        "/run_code", json=sf, headers={"authorization": f"Bearer {full}"}
                    ),
                ):
                    assert r.status_code == 429, r.text
                    assert r.json()["error"]["code"] == "quota_exceeded"
                # bad input is still SandboxFusion's answer, and spends none of the rate:
                # one call passes admission, the next is refused with when to retry
                bad = {"code": "x", "language": "cobol"}
                r = await http.post(f"/k/{slow}/run_code", json=bad)
                assert r.status_code == 200 and r.json()["status"] == "SandboxError"
                r = await http.post(f"/k/{slow}/run_code", json=sf)
                assert r.status_code == 200 and "no layer store" in r.json()["message"]
                r = await http.post(f"/k/{slow}/run_code", json=sf)
                assert r.status_code == 429
                assert r.json()["error"]["code"] == "creation_rate_exceeded"
                assert r.json()["error"]["details"]["retry_after_s"] > 0
            # memory: a call without a limit counts as a default worker (1024 MiB)
            with pytest.raises(QuotaExceeded) as e:
                await cs.run_code("echo hi", "bash")
            assert e.value.details["quota"] == "max_memory_mb"
            assert e.value.details["requested"] == 1024
            with pytest.raises(TierUnavailable, match="no layer store"):  # admitted
                await cs.run_code("echo hi", "bash", memory_mb=256)
            # freed: the key's sandbox is gone, so is the refusal; another key was never held
            await held.kill()
            with pytest.raises(TierUnavailable):
                await cf.run_code("echo hi", "bash")
            with pytest.raises(TierUnavailable):
                await c.run_code("echo hi", "bash")
            # nothing was made, nothing is left held
            assert [s.id for s in edge.sandboxes.values() if s.state != "stopped"] == []
            assert (await cs.key_info()).usage == KeyUsage()
            assert len(edge.calls_to("run_code")) == 5
            assert len(edge.calls_to("run_code_sandboxfusion")) == 5
            # both verbs take (req, owner), as every verb of the edge does
            from dsec.models import CodeRunRequest, RunCodeRequest

            first, *_ = edge.calls_to("run_code")
            assert isinstance(first["req"], CodeRunRequest) and first["owner"] == keys.verify(full)
            sf_first, *_ = edge.calls_to("run_code_sandboxfusion")
            assert isinstance(sf_first["req"], RunCodeRequest)
            assert sf_first["owner"] == keys.verify(full)
    finally:
        await close_app(app)
        await edge.close()


def test_a_code_run_counts_as_an_fncall_worker() -> None:
    from dsec.runtimes.fncall.pool import PoolConfig

    assert (CODE_RUN_CPU, CODE_RUN_MEMORY_MB) == (PoolConfig().cpu, PoolConfig().memory_mb)
    assert code_run_size(CodeRunRequest(code="", language="c")) == (1.0, 1024)
    assert code_run_size(CodeRunRequest(code="", language="c", memory_mb=300)) == (1.0, 300)
    assert code_run_size(RunCodeRequest(code="", language="c")) == (1.0, 1024)  # -1: none
    assert code_run_size(RunCodeRequest(code="", language="c", memory_limit_MB=300)) == (1.0, 300)
