// One sandbox: its request and limits, live CPU and memory, the trajectory log (each
// command, its output and exit code, replayed or not), a file browser, the start command's
// logs (where the server keeps them), its audit (the refusals made on its behalf: evidence of
// cheating) and, for a desktop, its screen.
import { html } from "htm/preact";
import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import { ApiError, get, getText, streamLines } from "../api.js";
import { Chart } from "../chart.js";
import { age, bytes, labels } from "../format.js";
import { usePoll } from "../poll.js";
import { Table } from "../table.js";
import { act } from "./sandboxes.js";

const KEEP = 180; // samples of the live chart (6 minutes at 2 s)

function Info({ s }) {
  const rows = [
    ["tier", s.tier],
    ["image", s.image],
    ["layers", (s.layers || []).join(", ") || "–"],
    ["state", s.state + (s.stopped_reason ? ` (${s.stopped_reason})` : "")],
    ["cores", s.cpu],
    ["memory", `${s.memory_mb} MiB`],
    ["disk", `${s.disk_mb} MiB`],
    ["processes", s.pids],
    ["job", s.job || "–"],
    ["labels", labels(s.labels) || "–"],
    ["user / workdir", `${s.user || "default"} · ${s.workdir}`],
    ["created", `${new Date(s.created_at).toLocaleString()} (${age(s.created_at)} ago)`],
    ["expires", s.expires_at ? new Date(s.expires_at).toLocaleString() : "–"],
    ["on timeout", s.on_timeout],
    ["network", s.network ? JSON.stringify(s.network) : "none"],
    ["next seq", s.next_seq],
  ];
  return html`<table class="kv" data-testid="sandbox-info">
    ${rows.map(([k, v]) => html`<tr><th>${k}</th><td>${String(v)}</td></tr>`)}
  </table>`;
}

function Live({ id, active }) {
  const samples = useRef([]);
  const [, setN] = useState(0);
  const [latest, setLatest] = useState(null);
  const [err, setErr] = useState(null);
  useEffect(() => {
    if (!active) return undefined;
    let alive = true;
    const tick = async () => {
      try {
        const m = await get(`/v1/sandboxes/${encodeURIComponent(id)}/metrics`);
        if (!alive) return;
        samples.current = [...samples.current, m].slice(-KEEP);
        setLatest(m);
        setErr(null);
        setN((n) => n + 1);
      } catch (e) {
        if (alive) setErr(e.message);
      }
    };
    tick();
    const timer = setInterval(tick, 2000);
    return () => {
      alive = false;
      clearInterval(timer);
    };
  }, [id, active]);
  const ss = samples.current;
  const t = ss.map((m) => new Date(m.timestamp).getTime() / 1000);
  return html`<div data-testid="live-metrics">
    ${err ? html`<p class="muted">metrics: ${err}</p>` : null}
    ${latest
      ? html`<p data-testid="metrics-now">
          cpu <b>${latest.cpu.used_cores.toFixed(2)}</b> of ${latest.cpu.limit_cores} cores ·
          memory <b>${bytes(latest.memory.used_bytes)}</b>${latest.memory.limit_bytes ? ` of ${bytes(latest.memory.limit_bytes)}` : ""} ·
          disk ${bytes(latest.disk.used_bytes)} of ${bytes(latest.disk.total_bytes)} ·
          network ${latest.network ? `rx ${bytes(latest.network.rx_bytes)} tx ${bytes(latest.network.tx_bytes)}` : "none"}
          <span class="muted">(${latest.source})</span></p>`
      : null}
    <div class="charts">
      <${Chart} span=${KEEP * 2} testid="chart-cpu" title="CPU (cores)" t=${t} series=${[{ label: "used", values: ss.map((m) => m.cpu.used_cores) }]} />
      <${Chart} span=${KEEP * 2} testid="chart-memory" title="memory (MiB)" t=${t}
        series=${[{ label: "used", values: ss.map((m) => m.memory.used_bytes / 1048576), unit: " MiB" },
                  { label: "cache", values: ss.map((m) => m.memory.cache_bytes / 1048576), unit: " MiB" }]} />
    </div>
  </div>`;
}

function summary(e) {
  const r = e.request || {};
  if (e.op === "exec") return Array.isArray(r.cmd) ? r.cmd.join(" ") : String(r.cmd ?? "");
  return r.path || r.src || r.name || "";
}

function shown(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "object" && v.$sha256) return `(${v.size} bytes, sha256 ${v.$sha256.slice(0, 12)}…)`;
  return typeof v === "string" ? v : JSON.stringify(v, null, 2);
}

export function parseTrajectory(text) {
  const lines = text.split("\n").filter((l) => l.trim());
  const out = [];
  for (const line of lines) {
    try {
      const e = JSON.parse(line);
      if (e.type === "entry") out.push(e);
    } catch (_) {
      /* skip */
    }
  }
  return out;
}

function Trajectory({ id }) {
  const [data, error] = usePoll(() => getText(`/v1/sandboxes/${encodeURIComponent(id)}/trajectory`), 3000, [id]);
  const [open, setOpen] = useState(null);
  const entries = useMemo(() => (data ? parseTrajectory(data) : []), [data]);
  const rows = entries.map((e) => ({
    id: e.seq,
    seq: e.seq,
    op: e.op,
    what: summary(e),
    exit_code: e.exit_code ?? (e.status === "error" ? "error" : ""),
    status: e.status,
    replays: e.replays || 0,
    ms: e.timings && e.timings.run_ms !== undefined ? Number(e.timings.run_ms).toFixed(1) : "",
  }));
  const chosen = entries.find((e) => e.seq === open);
  const columns = useMemo(
    () => [
      { title: "seq", field: "seq", width: 70 },
      { title: "op", field: "op", width: 110 },
      { title: "command / path", field: "what" },
      { title: "exit", field: "exit_code", width: 70 },
      { title: "status", field: "status", width: 90 },
      { title: "replayed", field: "replays", width: 100, formatter: (c) => (c.getValue() ? `yes (${c.getValue()}×)` : "no") },
      { title: "ms", field: "ms", width: 80, hozAlign: "right" },
    ],
    [],
  );
  const onReady = (t) => t.on("rowClick", (_e, row) => setOpen(row.getData().seq));
  return html`<div data-testid="trajectory">
    ${error ? html`<p class="error">${error.message}</p>` : null}
    <${Table} testid="trajectory-table" index="id" columns=${columns} data=${rows} onReady=${onReady}
      options=${{ pagination: true, paginationSize: 25, placeholder: "no state-changing calls yet" }} />
    ${chosen
      ? html`<div class="entry" data-testid="trajectory-entry">
          <h4>seq ${chosen.seq}: ${chosen.op} · ${chosen.status}${chosen.replays ? ` · replayed ${chosen.replays}×` : " · not replayed"}</h4>
          <pre class="cmd">${summary(chosen)}</pre>
          ${chosen.result && chosen.result.stdout !== undefined
            ? html`<h5>stdout</h5><pre data-testid="entry-stdout">${shown(chosen.result.stdout)}</pre>
                <h5>stderr</h5><pre data-testid="entry-stderr">${shown(chosen.result.stderr)}</pre>
                <p>exit code <b data-testid="entry-exit">${chosen.result.exit_code ?? "–"}</b>${chosen.result.timed_out ? " (timed out)" : ""}</p>`
            : html`<pre>${shown(chosen.result)}</pre>`}
        </div>`
      : null}
  </div>`;
}

function Audit({ id }) {
  const [data, error] = usePoll(() => get(`/v1/sandboxes/${encodeURIComponent(id)}/audit`), 3000, [id]);
  const rows = (data ? data.entries : []).map((e) => ({
    id: e.id,
    when: new Date(e.ts * 1000).toLocaleTimeString(),
    after_seq: e.seq ?? "",
    what: `${e.category}.${e.kind}`,
    count: e.count,
    process: [e.pid !== null && e.pid !== undefined ? `pid ${e.pid}` : "", e.comm || "", e.cmdline || e.exe || ""]
      .filter(Boolean)
      .join(" · "),
    detail: e.detail,
  }));
  const columns = useMemo(
    () => [
      { title: "#", field: "id", width: 60 },
      { title: "when", field: "when", width: 100 },
      { title: "after seq", field: "after_seq", width: 90 },
      { title: "what", field: "what", width: 170 },
      { title: "count", field: "count", width: 70, hozAlign: "right" },
      { title: "process", field: "process", width: 220 },
      { title: "refused", field: "detail" },
    ],
    [],
  );
  if (error) return html`<p class="error">${error.message}</p>`;
  if (!data) return html`<p>loading…</p>`;
  if (!data.enabled) return html`<p class="muted" data-testid="audit-off">this node records no audit (DSEC_AUDIT=off)</p>`;
  const counts = Object.entries(data.counts || {});
  return html`<div data-testid="audit">
    <p data-testid="audit-verdict">
      ${data.evidence ? html`<b class="error">evidence of cheating</b>` : "no evidence"} ·
      ${data.total} refusal${data.total === 1 ? "" : "s"}${data.dropped ? ` · ${data.dropped} details not kept (cap ${data.cap})` : ""}
    </p>
    ${counts.length
      ? html`<table class="kv" data-testid="audit-counts">
          ${counts.map(([k, v]) => html`<tr><th>${k}</th><td>${v}</td></tr>`)}
        </table>`
      : null}
    <${Table} testid="audit-table" index="id" columns=${columns} data=${rows}
      options=${{ pagination: true, paginationSize: 25, placeholder: "nothing refused" }} />
  </div>`;
}

function Files({ id, state }) {
  const [path, setPath] = useState("/");
  const [entries, setEntries] = useState(null);
  const [error, setError] = useState(null);
  const [file, setFile] = useState(null);
  const [confirmed, setConfirmed] = useState(state !== "paused");
  const load = async (p) => {
    setError(null);
    try {
      const r = await get(`/v1/sandboxes/${encodeURIComponent(id)}/files/list`, { path: p, depth: 1 });
      setEntries(r.entries.filter((e) => e.path !== p).sort((a, b) => (a.type === "dir") === (b.type === "dir") ? a.path.localeCompare(b.path) : a.type === "dir" ? -1 : 1));
      setPath(p);
      setFile(null);
    } catch (e) {
      setError(e.message);
    }
  };
  useEffect(() => {
    if (confirmed) load("/");
  }, [id, confirmed]);
  if (!confirmed)
    return html`<p>Browsing files resumes a paused sandbox.
      <button onClick=${() => setConfirmed(true)} data-testid="browse-anyway">browse anyway</button></p>`;
  const open = async (e) => {
    if (e.type === "dir") return load(e.path);
    try {
      const text = await getText(`/v1/sandboxes/${encodeURIComponent(id)}/files`, { path: e.path });
      setFile({ path: e.path, text: text.length > 262144 ? text.slice(0, 262144) + "\n…" : text });
    } catch (err) {
      setError(err.message);
    }
  };
  const up = path === "/" ? null : path.replace(/\/[^/]+\/?$/, "") || "/";
  return html`<div class="files" data-testid="files">
    <p><code data-testid="files-path">${path}</code> ${up ? html`<button class="link" onClick=${() => load(up)}>↑ up</button>` : null}</p>
    ${error ? html`<p class="error">${error}</p>` : null}
    <ul class="file-list">
      ${(entries || []).map(
        (e) => html`<li>
          <button class="link" onClick=${() => open(e)} data-testid="file-entry">${e.path.split("/").pop()}${e.type === "dir" ? "/" : ""}</button>
          <span class="muted">${e.type === "dir" ? "" : bytes(e.size)}</span>
          ${e.type === "file" ? html`<a class="muted" href=${`/v1/sandboxes/${encodeURIComponent(id)}/files?path=${encodeURIComponent(e.path)}`} download>download</a>` : null}
        </li>`,
      )}
    </ul>
    ${file ? html`<h4>${file.path}</h4><pre data-testid="file-content">${file.text}</pre>` : null}
  </div>`;
}

function Logs({ id }) {
  const [lines, setLines] = useState([]);
  const [error, setError] = useState(null);
  useEffect(() => {
    const ctl = new AbortController();
    setLines([]);
    streamLines(`/v1/sandboxes/${encodeURIComponent(id)}/logs`, { follow: "true" }, (l) =>
      setLines((old) => [...old, l].slice(-2000)), ctl.signal,
    ).catch((e) => {
      if (!(e instanceof DOMException)) setError(e.message);
    });
    return () => ctl.abort();
  }, [id]);
  return html`<div data-testid="logs">
    ${error ? html`<p class="error">${error}</p>` : null}
    <pre class="logs">${lines.map((l) => html`<span class=${l.stream === "stderr" ? "stderr" : ""}>${l.data}</span>`)}</pre>
  </div>`;
}

function Screen({ id, session, running }) {
  const [ts, setTs] = useState(Date.now());
  const [vnc, setVnc] = useState(false);
  // the port proxy does not take the dashboard's session: the sandbox's access token (asked
  // with the session) opens the noVNC page, and the cookie it sets covers its WebSocket
  const [token, setToken] = useState(null);
  useEffect(() => {
    if (!vnc || token) return;
    get(`/v1/sandboxes/${encodeURIComponent(id)}/ports`).then((a) => setToken(a.token), () => setVnc(false));
  }, [vnc, id]);
  useEffect(() => {
    if (!running) return undefined;
    const timer = setInterval(() => document.visibilityState === "visible" && setTs(Date.now()), 2000);
    return () => clearInterval(timer);
  }, [running]);
  const base = `/v1/sandboxes/${encodeURIComponent(id)}`;
  return html`<div data-testid="screen">
    ${session.features.port_proxy
      ? html`<p><label><input type="checkbox" checked=${vnc} onChange=${(e) => setVnc(e.target.checked)} data-testid="vnc-toggle" /> live view (noVNC through the port proxy)</label></p>`
      : html`<p class="muted">live view needs the port proxy (not on this server): refreshed screenshots every 2 s</p>`}
    ${vnc && token
      ? html`<iframe class="vnc" data-testid="vnc" src=${`${base}/ports/6080/vnc.html?autoconnect=1&resize=scale&path=${encodeURIComponent(`${base.slice(1)}/ports/6080/websockify`)}&dsec_token=${encodeURIComponent(token)}`}></iframe>`
      : running
        ? html`<img class="screenshot" data-testid="screenshot" alt="screen" src=${`${base}/display/screenshot?ts=${ts}`} />`
        : html`<p class="muted">the sandbox is not running (a screenshot would resume it)</p>`}
  </div>`;
}

export function SandboxPage({ id, session }) {
  const [tab, setTab] = useState("trajectory");
  const [message, setMessage] = useState(null);
  const [data, error, reload] = usePoll(() => get(`/v1/sandboxes/${encodeURIComponent(id)}`), 2000, [id]);
  if (error && error instanceof ApiError && error.status === 404)
    return html`<p class="error" data-testid="not-found">sandbox ${id} not found</p>`;
  if (error) return html`<p class="error">${error.message}</p>`;
  if (!data) return html`<p>loading…</p>`;
  const caps = (session.tiers || []).find((c) => c.tier === data.tier) || {};
  const live = data.state === "running" || data.state === "paused";
  const doAct = async (action) => {
    const r = await act(action, [id]);
    setMessage(r.failed.length ? r.failed.join("; ") : `${action}: ok`);
    reload();
  };
  const tabs = [
    ["trajectory", "trajectory"],
    ["files", "files"],
    ...(session.features.logs ? [["logs", "logs"]] : []),
    ...(session.features.audit ? [["audit", "audit"]] : []),
    ...(caps.display ? [["screen", "screen"]] : []),
  ];
  return html`<section data-testid="sandbox-page">
    <h1><code data-testid="sandbox-id">${id}</code> <span class=${`state ${data.state}`} data-testid="sandbox-state">${data.state}</span></h1>
    <div class="toolbar">
      <button disabled=${data.state !== "running"} onClick=${() => doAct("pause")} data-testid="pause">pause</button>
      <button disabled=${data.state !== "paused"} onClick=${() => doAct("resume")} data-testid="resume">resume</button>
      <button class="danger" disabled=${!live} onClick=${() => doAct("kill")} data-testid="kill">kill</button>
      ${message ? html`<span class="note" data-testid="action-message">${message}</span>` : null}
    </div>
    <div class="two">
      <div><h2>Request and limits</h2><${Info} s=${data} /></div>
      <div><h2>Live usage</h2>
        ${session.features.metrics && caps.metrics !== false
          ? html`<${Live} id=${id} active=${live} />`
          : html`<p class="muted">this tier cannot measure its sandboxes</p>`}
      </div>
    </div>
    <nav class="tabs">
      ${tabs.map(([k, label]) => html`<button class=${tab === k ? "active" : ""} onClick=${() => setTab(k)} data-testid=${"tab-" + k}>${label}</button>`)}
    </nav>
    ${tab === "trajectory" ? html`<${Trajectory} id=${id} />` : null}
    ${tab === "files" && live ? html`<${Files} id=${id} state=${data.state} />` : null}
    ${tab === "files" && !live ? html`<p class="muted">the sandbox is stopped</p>` : null}
    ${tab === "logs" ? html`<${Logs} id=${id} />` : null}
    ${tab === "audit" ? html`<${Audit} id=${id} />` : null}
    ${tab === "screen" ? html`<${Screen} id=${id} session=${session} running=${data.state === "running"} />` : null}
  </section>`;
}
