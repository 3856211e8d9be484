// Jobs: every sandbox of a training job, paused, resumed or killed as one.
import { html } from "htm/preact";
import { useState } from "preact/hooks";
import { get } from "../api.js";
import { usePoll } from "../poll.js";
import { Table } from "../table.js";
import { jobAction } from "./sandboxes.js";

function jobLink(cell) {
  const a = document.createElement("a");
  a.href = `#/sandboxes?job=${encodeURIComponent(cell.getValue())}`;
  a.textContent = cell.getValue();
  return a;
}

export function Jobs() {
  const [message, setMessage] = useState(null);
  const [data, , reload] = usePoll(() => get("/v1/sandboxes"), 3000);
  const by = {};
  for (const s of data ? data.sandboxes : []) {
    if (!s.job) continue;
    const j = (by[s.job] = by[s.job] || { id: s.job, job: s.job, sandboxes: 0, running: 0, paused: 0, creating: 0, tiers: new Set() });
    j.sandboxes += 1;
    j[s.state] = (j[s.state] || 0) + 1;
    j.tiers.add(s.tier);
  }
  const rows = Object.values(by).map((j) => ({ ...j, tiers: [...j.tiers].sort().join(", ") }));
  const act = async (job, action) => {
    const r = await jobAction(job, action);
    setMessage(`${action} ${job}: ${r.ok} ok, ${r.failed} failed`);
    reload();
  };
  const button = (action, cls) => (cell) => {
    const b = document.createElement("button");
    b.textContent = action;
    if (cls) b.className = cls;
    b.dataset.testid = `job-${action}`;
    b.onclick = (e) => {
      e.stopPropagation();
      act(cell.getRow().getData().job, action);
    };
    return b;
  };
  return html`<section data-testid="jobs">
    <h1>Jobs</h1>
    ${message ? html`<p class="note" data-testid="action-message">${message}</p>` : null}
    <${Table} testid="job-table" data=${rows}
      columns=${[
        { title: "job", field: "job", formatter: jobLink },
        { title: "sandboxes", field: "sandboxes", width: 110 },
        { title: "running", field: "running", width: 100 },
        { title: "paused", field: "paused", width: 100 },
        { title: "tiers", field: "tiers" },
        { title: "", formatter: button("pause"), width: 90, headerSort: false },
        { title: "", formatter: button("resume"), width: 90, headerSort: false },
        { title: "", formatter: button("kill", "danger"), width: 90, headerSort: false },
      ]}
      options=${{ pagination: true, paginationSize: 50, placeholder: "no sandbox has a job" }} />
  </section>`;
}
