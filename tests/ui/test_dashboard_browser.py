"""The dashboard in a real browser (chromium via Playwright): sign-in and its bad inputs, a
sandbox made through the SDK appearing without a reload, actions from the page, the
trajectory view, a second key seeing none of the first key's sandboxes, the operator view."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from tests.ui.conftest import ALICE, BOB, OPERATOR, Evidence, UiServer, sign_in

from dsec import Sandbox


def _sdk(ui_server: UiServer, key: str, **kw: Any) -> Sandbox:
    return Sandbox.create(url=ui_server.url, api_key=key, **kw)


def test_sign_in_refuses_a_wrong_key_and_shows_nothing_else(
    ui_server: UiServer, new_page: Any, evidence: Evidence
) -> None:
    page = new_page()
    page.goto(f"{ui_server.url}/ui")
    evidence.shot(page, "sign-in")
    page.fill("#key", "dsec_this_is_not_a_key")
    page.click("button[type=submit]")
    page.wait_for_selector(".signin-error")
    assert "invalid or revoked API key" in page.inner_text(".signin-error")
    assert page.locator("[data-testid=overview]").count() == 0
    assert page.locator("nav").count() == 0
    evidence.shot(page, "wrong-key")
    # the key typed is not kept anywhere the page can read
    sign_in(page, ui_server.url, ALICE)
    assert ALICE not in page.content()
    assert page.evaluate("document.cookie") == ""  # HttpOnly: scripts see no cookie
    assert page.evaluate("JSON.stringify(localStorage) + JSON.stringify(sessionStorage)") == "{}{}"
    cookie = next(c for c in page.context.cookies() if c["name"] == "dsec_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    evidence.shot(page, "overview")


def test_a_forged_or_expired_session_goes_back_to_sign_in(
    ui_server: UiServer, new_page: Any, evidence: Evidence
) -> None:
    page = new_page()
    sign_in(page, ui_server.url, ALICE)
    page.context.clear_cookies()
    page.context.add_cookies(
        [{"name": "dsec_session", "value": "v1.e30.forged", "url": ui_server.url}]
    )
    page.goto(f"{ui_server.url}/ui#/sandboxes")
    page.wait_for_selector("#key")
    evidence.shot(page, "forged")
    # a page already open whose session ends: its next call sends it to sign-in
    sign_in(page, ui_server.url, ALICE)
    page.click("[data-testid=nav-sandboxes]")
    page.wait_for_selector("[data-testid=sandbox-table]")
    page.context.clear_cookies()
    page.wait_for_selector("#key")  # the table's next refresh answered 401


def test_a_sandbox_appears_live_is_killed_from_the_page_and_shows_its_trajectory(
    ui_server: UiServer, new_page: Any, evidence: Evidence
) -> None:
    page = new_page()
    sign_in(page, ui_server.url, ALICE)
    page.click("[data-testid=nav-sandboxes]")
    page.wait_for_selector("[data-testid=sandbox-table]")
    sb = _sdk(ui_server, ALICE, labels={"task": "browser"}, job="trail")
    sb.commands.run("echo hello from the sdk")
    sb.commands.run("exit 3")
    sb.files.write("/work/result.txt", "42\n")
    # no reload: the table's own refresh brings the new row
    link = page.locator("[data-testid=sandbox-link]", has_text=sb.id)
    link.wait_for()
    evidence.shot(page, "sandboxes")
    link.click()
    page.wait_for_selector("[data-testid=sandbox-page]")
    assert page.inner_text("[data-testid=sandbox-id]") == sb.id
    page.locator("[data-testid=trajectory-table] .tabulator-row", has_text="echo hello").wait_for()
    rows = page.locator("[data-testid=trajectory-table] .tabulator-row")
    assert rows.count() == 3
    assert "exit 3" in rows.nth(1).inner_text() and "3" in rows.nth(1).inner_text()
    rows.first.click()
    page.wait_for_selector("[data-testid=trajectory-entry]")
    assert page.inner_text("[data-testid=entry-stdout]") == "hello from the sdk\n"
    assert page.inner_text("[data-testid=entry-exit]") == "0"
    assert "not replayed" in page.inner_text("[data-testid=trajectory-entry]")
    page.wait_for_selector("[data-testid=metrics-now]")  # live usage from /metrics
    evidence.shot(page, "sandbox")

    # a repeat the edge answers from the log (a client without the log, resending seq 4)
    # shows as replayed
    for _ in range(2):
        r = httpx.post(
            f"{ui_server.url}/v1/sandboxes/{sb.id}/exec",
            json={"cmd": "echo sent twice"},
            headers={"authorization": f"Bearer {ALICE}", "x-dsec-seq": "4"},
        )
        assert r.status_code == 200, r.text
    assert r.json()["replayed"] is True
    replayed = page.locator("[data-testid=trajectory-table] .tabulator-row", has_text="sent twice")
    replayed.wait_for()
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-testid=trajectory-table] .tabulator-row')]"
        ".some(r => r.innerText.includes('sent twice') && r.innerText.includes('yes (1'))"
    )

    # the file browser
    page.click("[data-testid=tab-files]")
    page.locator("[data-testid=file-entry]", has_text="work/").click()
    page.locator("[data-testid=file-entry]", has_text="result.txt").click()
    assert page.inner_text("[data-testid=file-content]") == "42\n"
    evidence.shot(page, "files")

    # kill from the page: the SDK sees it stopped
    page.click("[data-testid=kill]")
    page.locator("[data-testid=sandbox-state]", has_text="stopped").wait_for()
    assert sb.refresh().state == "stopped"
    assert ui_server.edge.calls_to("kill_sandbox")[-1]["owner"] == ui_server.owner(ALICE)
    evidence.shot(page, "killed")


def test_table_actions_and_job_actions(
    ui_server: UiServer, new_page: Any, evidence: Evidence
) -> None:
    made = [_sdk(ui_server, ALICE, job="batch-7") for _ in range(3)]
    page = new_page()
    sign_in(page, ui_server.url, ALICE)
    page.goto(f"{ui_server.url}/ui#/sandboxes?job=batch-7")
    for sb in made:
        page.locator("[data-testid=sandbox-link]", has_text=sb.id).wait_for()
    # only the job's rows are shown (the header filter came from the URL)
    assert page.locator("[data-testid=sandbox-link]").count() == 3
    row = page.locator(".tabulator-row", has_text=made[0].id)
    row.locator(".tabulator-cell").first.click()  # the selection checkbox
    page.click("[data-testid=pause-selected]")
    page.locator("[data-testid=action-message]", has_text="pause: 1 ok").wait_for()
    page.locator(".tabulator-row", has_text=made[0].id).locator(".state.paused").wait_for()
    assert made[0].refresh().state == "paused" and made[1].refresh().state == "running"
    page.select_option("[data-testid=job-select]", "batch-7")
    page.click("[data-testid=pause-job]")
    page.locator("[data-testid=action-message]", has_text="pause job batch-7: 3 ok").wait_for()
    assert {sb.refresh().state for sb in made} == {"paused"}
    evidence.shot(page, "paused-job")
    page.click("[data-testid=nav-jobs]")
    page.locator("[data-testid=job-table] .tabulator-row", has_text="batch-7").wait_for()
    evidence.shot(page, "jobs")
    page.locator("[data-testid=job-table] .tabulator-row", has_text="batch-7").locator(
        "[data-testid=job-resume]"
    ).click()
    page.locator("[data-testid=action-message]", has_text="resume batch-7: 3 ok").wait_for()
    page.locator("[data-testid=job-table] .tabulator-row", has_text="batch-7").locator(
        "[data-testid=job-kill]"
    ).click()
    page.locator("[data-testid=action-message]", has_text="kill batch-7: 3 ok").wait_for()
    assert {sb.refresh().state for sb in made} == {"stopped"}


def test_a_second_key_sees_none_of_the_first_keys_sandboxes(
    ui_server: UiServer, new_page: Any, evidence: Evidence
) -> None:
    mine = _sdk(ui_server, ALICE, job="alice-only", labels={"secret": "alice"})
    mine.commands.run("echo alice's command")
    bob = new_page()
    sign_in(bob, ui_server.url, BOB)
    assert bob.inner_text("[data-testid=my-count]") == "0"
    bob.click("[data-testid=nav-sandboxes]")
    bob.wait_for_selector("[data-testid=sandbox-table] .tabulator-placeholder")
    bob.wait_for_timeout(2500)  # a refresh later: still nothing
    assert bob.locator("[data-testid=sandbox-link]").count() == 0
    bob.click("[data-testid=nav-jobs]")
    bob.wait_for_selector("[data-testid=job-table]")
    assert "alice-only" not in bob.content()
    bob.goto(f"{bob.url.split('#')[0]}#/sandboxes/{mine.id}")
    bob.wait_for_selector("[data-testid=not-found]")
    assert "alice" not in bob.inner_text("main").replace(mine.id, "")
    evidence.shot(bob, "not-found")
    # nor through the API with its cookie
    status = bob.evaluate(
        "async (id) => (await fetch(`/v1/sandboxes/${id}/trajectory`)).status", mine.id
    )
    assert status == 404
    assert mine.refresh().state == "running"
    mine.kill()


def test_the_operator_view(ui_server: UiServer, new_page: Any, evidence: Evidence) -> None:
    a = _sdk(ui_server, ALICE)
    b = _sdk(ui_server, BOB)
    page = new_page()
    sign_in(page, ui_server.url, OPERATOR)
    page.wait_for_selector("[data-testid=operator-badge]")
    page.wait_for_selector("[data-testid=capacity]")
    tenants = page.locator("[data-testid=tenants] .tabulator-row")
    tenants.first.wait_for()
    owners = page.inner_text("[data-testid=tenants]")
    assert ui_server.owner(ALICE) in owners and ui_server.owner(BOB) in owners
    page.wait_for_selector("[data-testid=chart-node-cpu] canvas")
    page.wait_for_selector("[data-testid=chart-latency] canvas")
    evidence.shot(page, "operator-overview")
    page.click("[data-testid=nav-images]")
    page.locator("[data-testid=image-table] .tabulator-row", has_text="busybox").wait_for()
    page.wait_for_selector("[data-testid=builds-unavailable]")
    evidence.shot(page, "images")
    a.kill()
    b.kill()


@pytest.mark.slow
def test_the_table_paginates_two_thousand_sandboxes(
    ui_server: UiServer, new_page: Any, evidence: Evidence
) -> None:
    from dsec.models import CreateSandboxRequest

    async def fill() -> list[str]:
        req = CreateSandboxRequest(job="many")
        return [
            (await ui_server.edge.create_sandbox(req, ui_server.owner(ALICE))).id
            for _ in range(2000)
        ]

    ids = ui_server.call(fill(), timeout=600)
    page = new_page()
    sign_in(page, ui_server.url, ALICE)
    page.goto(f"{ui_server.url}/ui#/sandboxes")
    page.wait_for_function(
        "() => (document.querySelector('.tabulator-page-counter') || {}).innerText"
        "?.includes('of 2000 rows')"
    )
    # a page of rows in the DOM, not 2,000
    assert page.locator("[data-testid=sandbox-link]").count() <= 50
    page.locator(".tabulator-col[tabulator-field=id] input").press_sequentially(ids[1234])
    page.wait_for_function(
        "() => document.querySelectorAll('[data-testid=sandbox-link]').length === 1"
    )
    assert page.inner_text("[data-testid=sandbox-link]") == ids[1234]
    evidence.shot(page, "filtered")
    page.select_option("[data-testid=job-select]", "many")
    page.click("[data-testid=kill-job]")
    page.locator("[data-testid=action-message]", has_text="kill job many: 2000 ok").wait_for(
        timeout=120_000
    )
