// Sandboxes: a live table (refreshed every 2 s, paginated by Tabulator) filtered by id,
// job, label, tier and state, with pause / resume / kill of the selected rows and the
// actions of a whole job.
import { html } from "htm/preact";
import { useMemo, useRef, useState } from "preact/hooks";
import { del, get, post } from "../api.js";
import { age, labels } from "../format.js";
import { usePoll } from "../poll.js";
import { Table } from "../table.js";

const TIERS = ["fncall", "container", "microvm", "vm"];
const STATES = ["creating", "running", "paused", "stopped"];

export function rows(list) {
  return list.map((s) => ({
    id: s.id,
    tier: s.tier,
    state: s.state,
    image: s.image,
    job: s.job || "",
    labels: labels(s.labels),
    cpu: s.cpu,
    memory_mb: s.memory_mb,
    created_at: s.created_at,
    paused_at: s.paused_at,
    node: s.node,
  }));
}

export async function act(action, ids) {
  const out = { ok: 0, failed: [] };
  await Promise.all(
    ids.map(async (id) => {
      try {
        if (action === "kill") await del(`/v1/sandboxes/${encodeURIComponent(id)}`);
        else await post(`/v1/sandboxes/${encodeURIComponent(id)}/${action}`);
        out.ok += 1;
      } catch (e) {
        out.failed.push(`${id}: ${e.message}`);
      }
    }),
  );
  return out;
}

export async function jobAction(job, action) {
  const r = await post(`/v1/jobs/${encodeURIComponent(job)}/${action}`);
  const outcomes = Object.values(r.outcomes);
  return { ok: outcomes.filter((o) => o.ok).length, failed: outcomes.filter((o) => !o.ok).length };
}

function idLink(cell) {
  const id = cell.getValue();
  const a = document.createElement("a");
  a.href = `#/sandboxes/${encodeURIComponent(id)}`;
  a.textContent = id;
  a.dataset.testid = "sandbox-link";
  return a;
}

function stateCell(cell) {
  const s = cell.getValue();
  const span = document.createElement("span");
  span.className = `state ${s}`;
  span.textContent = s;
  return span;
}

export function Sandboxes({ params }) {
  const [stopped, setStopped] = useState(false);
  const [message, setMessage] = useState(null);
  const [job, setJob] = useState(params.job || "");
  const table = useRef(null);
  const [data, error, reload] = usePoll(
    () => get("/v1/sandboxes", { include_stopped: stopped ? "true" : "" }),
    2000,
    [stopped],
  );
  const list = data ? rows(data.sandboxes) : [];
  const jobs = useMemo(() => [...new Set(list.map((r) => r.job).filter(Boolean))].sort(), [data]);

  const columns = useMemo(
    () => [
      { formatter: "rowSelection", titleFormatter: "rowSelection", hozAlign: "center", headerSort: false, width: 40 },
      { title: "id", field: "id", formatter: idLink, headerFilter: "input", minWidth: 230 },
      { title: "tier", field: "tier", headerFilter: "list", headerFilterParams: { values: TIERS, clearable: true }, width: 110 },
      { title: "state", field: "state", formatter: stateCell, headerFilter: "list", headerFilterParams: { values: STATES, clearable: true }, width: 110 },
      { title: "image", field: "image", headerFilter: "input" },
      { title: "job", field: "job", headerFilter: "input" },
      { title: "labels", field: "labels", headerFilter: "input" },
      { title: "cores", field: "cpu", width: 80, hozAlign: "right" },
      { title: "MiB", field: "memory_mb", width: 90, hozAlign: "right" },
      { title: "age", field: "created_at", width: 80, hozAlign: "right", formatter: (c) => age(c.getValue()), sorter: "string" },
    ],
    [],
  );

  async function onAction(action) {
    const ids = table.current ? table.current.getSelectedData().map((r) => r.id) : [];
    if (!ids.length) {
      setMessage("select sandboxes first");
      return;
    }
    const r = await act(action, ids);
    setMessage(`${action}: ${r.ok} ok${r.failed.length ? `, failed: ${r.failed.join("; ")}` : ""}`);
    table.current.deselectRow();
    reload();
  }

  async function onJob(action) {
    if (!job) return;
    const r = await jobAction(job, action);
    setMessage(`${action} job ${job}: ${r.ok} ok, ${r.failed} failed`);
    reload();
  }

  function ready(t) {
    table.current = t;
    if (params.job) t.setHeaderFilterValue("job", params.job);
    if (params.tier) t.setHeaderFilterValue("tier", params.tier);
    if (params.state) t.setHeaderFilterValue("state", params.state);
  }

  return html`<section data-testid="sandboxes">
    <h1>Sandboxes <span class="muted" data-testid="sandbox-count">${data ? list.length : ""}</span></h1>
    <div class="toolbar">
      <button onClick=${() => onAction("pause")} data-testid="pause-selected">pause</button>
      <button onClick=${() => onAction("resume")} data-testid="resume-selected">resume</button>
      <button class="danger" onClick=${() => onAction("kill")} data-testid="kill-selected">kill</button>
      <span class="sep"></span>
      <label>job <select value=${job} onChange=${(e) => setJob(e.target.value)} data-testid="job-select">
        <option value="">–</option>
        ${jobs.map((j) => html`<option value=${j}>${j}</option>`)}
      </select></label>
      <button disabled=${!job} onClick=${() => onJob("pause")} data-testid="pause-job">pause job</button>
      <button disabled=${!job} onClick=${() => onJob("resume")} data-testid="resume-job">resume job</button>
      <button class="danger" disabled=${!job} onClick=${() => onJob("kill")} data-testid="kill-job">kill job</button>
      <span class="sep"></span>
      <label><input type="checkbox" checked=${stopped} onChange=${(e) => setStopped(e.target.checked)} data-testid="include-stopped" /> stopped too</label>
    </div>
    ${message ? html`<p class="note" data-testid="action-message">${message}</p>` : null}
    ${error ? html`<p class="error">${error.message}</p>` : null}
    <${Table}
      testid="sandbox-table"
      columns=${columns}
      data=${list}
      onReady=${ready}
      options=${{
        pagination: true,
        paginationSize: 50,
        paginationCounter: "rows",
        selectableRows: true,
        height: "60vh",
        initialSort: [{ column: "created_at", dir: "desc" }],
      }}
    />
  </section>`;
}
