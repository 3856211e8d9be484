// Overview: nodes, capacity and usage, sandboxes by tier and state, and the last hour's
// creation rate, exec latency and errors (a key's own; the operator's: the node's).
import { html } from "htm/preact";
import { get } from "../api.js";
import { Chart } from "../chart.js";
import { bytes } from "../format.js";
import { usePoll } from "../poll.js";
import { Table } from "../table.js";

const STATES = ["creating", "running", "paused", "stopped"];

function TierStates({ by, testid }) {
  const tiers = Object.keys(by || {}).sort();
  if (!tiers.length) return html`<p class="muted" data-testid=${testid}>no sandboxes</p>`;
  return html`<table class="grid" data-testid=${testid}>
    <thead><tr><th>tier</th>${STATES.map((s) => html`<th>${s}</th>`)}</tr></thead>
    <tbody>
      ${tiers.map(
        (t) => html`<tr>
          <td>${t}</td>
          ${STATES.map((s) => html`<td data-cell=${t + "/" + s}>${(by[t] || {})[s] || 0}</td>`)}
        </tr>`,
      )}
    </tbody>
  </table>`;
}

function nodeByTierState(nodes) {
  const by = {};
  for (const n of nodes || []) {
    for (const [key, count] of Object.entries(n.by_tier_state || {})) {
      const [tier, state] = key.split("/");
      by[tier] = by[tier] || {};
      by[tier][state] = (by[tier][state] || 0) + count;
    }
  }
  return by;
}

function Bar({ label, used, cap, fmt = (x) => x }) {
  const frac = cap ? Math.min(1, used / cap) : 0;
  return html`<div class="bar-row">
    <span class="bar-label">${label}</span>
    <span class="bar"><span class="bar-fill" style=${{ width: `${(frac * 100).toFixed(1)}%` }}></span></span>
    <span class="bar-value">${fmt(used)} / ${fmt(cap)}</span>
  </div>`;
}

// the key's quota (set by the operator: dsec key set); a limit not set is not shown
function KeyQuota({ mine }) {
  const q = mine.quota;
  if (!q) return null;
  const bars = [];
  if (q.max_sandboxes != null) bars.push(html`<${Bar} label="sandboxes" used=${mine.sandboxes} cap=${q.max_sandboxes} />`);
  if (q.max_cpu != null) bars.push(html`<${Bar} label="cores" used=${mine.requested_cpu} cap=${q.max_cpu} />`);
  if (q.max_memory_mb != null)
    bars.push(html`<${Bar} label="memory" used=${mine.requested_memory_mb * 1048576} cap=${q.max_memory_mb * 1048576} fmt=${bytes} />`);
  return html`<div data-testid="my-quota">
    ${bars.length ? bars : html`<p class="muted">no quota beyond the node's</p>`}
    <p class="muted">${q.creations_per_s != null ? `${q.creations_per_s} creations/s · ` : ""}CPU weight ${q.cpu_weight}</p>
  </div>`;
}

export function Overview({ session }) {
  const [data, error] = usePoll(() => get("/ui/api/overview"), 5000);
  if (error) return html`<p class="error">${error.message}</p>`;
  if (!data) return html`<p>loading…</p>`;
  const a = data.activity;
  const perStep = `per ${data.step_s} s`;
  const mine = data.mine;
  const ns = data.node_series;
  const cap = data.capacity;
  return html`<section data-testid="overview">
    <h1>Overview</h1>
    <div class="cards">
      <div class="card"><h3>node</h3><p><b>${data.node.name}</b> · dsec ${data.node.version}</p>
        <p>${data.node.cpus} cores · ${bytes(data.node.memory_mb * 1048576)}</p>
        <p class="muted">tiers: ${Object.entries(data.node.tiers).filter(([, ok]) => ok).map(([t]) => t).join(", ")}</p></div>
      <div class="card" data-testid="my-usage"><h3>${data.operator ? "your key" : "your sandboxes"}</h3>
        <p><b data-testid="my-count">${mine.sandboxes}</b> live</p>
        <p>${mine.requested_cpu} cores · ${bytes(mine.requested_memory_mb * 1048576)} requested</p>
        <${KeyQuota} mine=${mine} /></div>
      ${cap
        ? html`<div class="card wide" data-testid="capacity"><h3>node capacity (admission caps)</h3>
            <${Bar} label="cores" used=${cap.requested_cpu} cap=${cap.cpu_cap} />
            <${Bar} label="memory" used=${cap.requested_memory_mb * 1048576} cap=${cap.memory_cap_mb * 1048576} fmt=${bytes} />
            <${Bar} label="sandboxes" used=${cap.sandboxes} cap=${cap.max_sandboxes} />
            ${cap.host_memory_total
              ? html`<${Bar} label="host memory" used=${cap.host_memory_used} cap=${cap.host_memory_total} fmt=${bytes} />`
              : null}
          </div>`
        : null}
    </div>
    <h2>Your sandboxes by tier and state</h2>
    <${TierStates} by=${mine.by_tier_state} testid="tier-states" />
    ${data.operator
      ? html`<h2>All sandboxes on the node${data.nodes.length > 1 ? "s" : ""}</h2>
          <${TierStates} by=${nodeByTierState(data.nodes)} testid="node-tier-states" />`
      : null}
    <h2>Last hour ${data.operator ? "(every key, through this apiserver)" : ""}</h2>
    <div class="charts">
      <${Chart} span=${3600} testid="chart-creations" title=${`sandboxes created (${perStep})`} t=${a.t}
        series=${[{ label: "created", values: a.creations }]} />
      <${Chart} span=${3600} testid="chart-latency" title="exec latency (ms)" t=${a.t}
        series=${[{ label: "p50", values: a.exec_p50_ms, unit: " ms" }, { label: "p95", values: a.exec_p95_ms, unit: " ms" }]} />
      <${Chart} span=${3600} testid="chart-errors" title=${`errors (${perStep})`} t=${a.t}
        series=${[{ label: "exec errors", values: a.exec_errors }, { label: "all errors", values: a.errors }, { label: "execs", values: a.execs }]} />
    </div>
    ${ns
      ? html`<h2>The node's own counters</h2>
          <div class="charts">
            <${Chart} span=${3600} testid="chart-node-cpu" title="host CPU (%)" t=${ns.t}
              series=${[{ label: "busy", values: ns.host_cpu_pct, unit: "%" }]} />
            <${Chart} span=${3600} testid="chart-node-sandboxes" title="sandboxes" t=${ns.t}
              series=${[{ label: "running", values: ns.running }, { label: "paused", values: ns.paused }]} />
            <${Chart} span=${3600} testid="chart-node-creations" title="creations and execs (per min)" t=${ns.t}
              series=${[{ label: "created", values: ns.creations_per_min }, { label: "execs", values: ns.execs_per_min }, { label: "exec errors", values: ns.exec_errors_per_min }]} />
            <${Chart} span=${3600} testid="chart-node-latency" title="edge exec latency (ms)" t=${ns.t}
              series=${[{ label: "p50", values: ns.exec_p50_ms, unit: " ms" }, { label: "p95", values: ns.exec_p95_ms, unit: " ms" }]} />
          </div>
          <h2>Nodes</h2>
          <${Table} testid="nodes" index="name" data=${data.nodes}
            columns=${[
              { title: "node", field: "name" },
              { title: "state", field: "state" },
              { title: "sandboxes", field: "sandboxes" },
              { title: "cores", field: "cpus" },
              { title: "memory", field: "memory_mb", formatter: (c) => bytes((c.getValue() || 0) * 1048576) },
            ]} />
          <h2>Tenants</h2>
          <${Table} testid="tenants" index="owner" data=${data.tenants}
            columns=${[
              { title: "owner", field: "owner" },
              { title: "sandboxes", field: "sandboxes" },
              { title: "cores requested", field: "cpu" },
              { title: "memory requested", field: "memory_mb", formatter: (c) => bytes(c.getValue() * 1048576) },
            ]} />`
      : null}
  </section>`;
}
