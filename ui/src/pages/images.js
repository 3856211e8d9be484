// Images and layers: sizes, kinds, how much of each lazy layer is on this node, and the
// build status of images being built.
import { html } from "htm/preact";
import { get } from "../api.js";
import { age, bytes, pct } from "../format.js";
import { usePoll } from "../poll.js";
import { Table } from "../table.js";

const frac = (c) => (c.getValue() === null || c.getValue() === undefined ? "–" : pct(c.getValue() * 100));

export function Images({ session }) {
  const [images] = usePoll(() => get("/v1/images"), 5000);
  const [layers] = usePoll(() => get("/v1/layers"), 10000);
  const imageRows = (images ? images.images : []).map((im) => ({
    id: `${im.owner}/${im.name}`,
    name: im.name,
    owner: im.owner + (im.shared ? " (shared)" : ""),
    status: im.status === "ready" ? "ready" : `${im.status}${im.progress ? `: ${im.progress}` : ""}`,
    layers: im.layers.length,
    size: im.size,
    cached: im.cached_fraction,
    created_at: im.created_at,
  }));
  const layerRows = (layers ? layers.layers : []).map((l) => ({
    id: l.digest,
    digest: l.digest,
    kind: l.kind,
    name: l.name || "",
    size: l.size,
    cached: l.cached_fraction,
    remote: l.remote || "local",
    created_at: l.created_at,
  }));
  return html`<section data-testid="images">
    <h1>Images</h1>
    <${Table} testid="image-table" data=${imageRows}
      columns=${[
        { title: "name", field: "name", headerFilter: "input" },
        { title: "owner", field: "owner", headerFilter: "input" },
        { title: "status", field: "status" },
        { title: "layers", field: "layers", width: 90, hozAlign: "right" },
        { title: "size", field: "size", width: 110, hozAlign: "right", formatter: (c) => bytes(c.getValue()) },
        { title: "on this node", field: "cached", width: 120, hozAlign: "right", formatter: frac },
        { title: "age", field: "created_at", width: 80, formatter: (c) => age(c.getValue()) },
      ]}
      options=${{ pagination: true, paginationSize: 25 }} />
    <h2>Layers</h2>
    <${Table} testid="layer-table" data=${layerRows}
      columns=${[
        { title: "digest", field: "digest", headerFilter: "input", minWidth: 200, formatter: (c) => c.getValue().slice(0, 19) + "…", tooltip: true },
        { title: "kind", field: "kind", width: 110, headerFilter: "list", headerFilterParams: { values: ["base", "workspace", "toolkit"], clearable: true } },
        { title: "name", field: "name" },
        { title: "size", field: "size", width: 110, hozAlign: "right", formatter: (c) => bytes(c.getValue()) },
        { title: "cached", field: "cached", width: 100, hozAlign: "right", formatter: frac },
        { title: "data", field: "remote" },
        { title: "age", field: "created_at", width: 80, formatter: (c) => age(c.getValue()) },
      ]}
      options=${{ pagination: true, paginationSize: 25 }} />
    <h2>Builds</h2>
    ${session.features.builds
      ? html`<p>see <code>GET /v1/builds</code></p>`
      : html`<p class="muted" data-testid="builds-unavailable">This server does not list image builds
          (images being built show their status above; <code>dsec image build</code> streams a
          build's log).</p>`}
  </section>`;
}
