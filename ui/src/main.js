// The dsec dashboard: a hash-routed single page (Preact + htm) over the /v1 API.
import "./style.css";
import { html, render } from "htm/preact";
import { useEffect, useState } from "preact/hooks";
import { get, setCsrf, signOut } from "./api.js";
import { Overview } from "./pages/overview.js";
import { Sandboxes } from "./pages/sandboxes.js";
import { SandboxPage } from "./pages/sandbox.js";
import { Images } from "./pages/images.js";
import { Jobs } from "./pages/jobs.js";

function useHash() {
  const [hash, setHash] = useState(window.location.hash || "#/");
  useEffect(() => {
    const on = () => setHash(window.location.hash || "#/");
    window.addEventListener("hashchange", on);
    return () => window.removeEventListener("hashchange", on);
  }, []);
  return hash;
}

function route(hash) {
  const [path, query] = hash.slice(1).split("?");
  const params = Object.fromEntries(new URLSearchParams(query || ""));
  const parts = path.split("/").filter(Boolean);
  return { parts, params };
}

function Nav({ session, active }) {
  const link = (href, name, label) =>
    html`<a href=${href} class=${active === name ? "active" : ""} data-testid=${"nav-" + name}>${label}</a>`;
  return html`<header class="top">
    <span class="brand">dsec</span>
    <nav>
      ${link("#/", "overview", "Overview")} ${link("#/sandboxes", "sandboxes", "Sandboxes")}
      ${link("#/jobs", "jobs", "Jobs")} ${link("#/images", "images", "Images")}
    </nav>
    <span class="who" data-testid="who">
      ${session.operator ? html`<span class="badge op" data-testid="operator-badge">operator</span>` : null}
      <code>${session.owner}</code> on <code>${session.node}</code>
      <button class="link" onClick=${signOut} data-testid="sign-out">sign out</button>
    </span>
  </header>`;
}

function App() {
  const [session, setSession] = useState(null);
  const [error, setError] = useState(null);
  const hash = useHash();
  useEffect(() => {
    get("/ui/api/session")
      .then((s) => {
        setCsrf(s.csrf);
        setSession(s);
      })
      .catch((e) => setError(e.message));
  }, []);
  if (error) return html`<main class="page"><p class="error">${error}</p></main>`;
  if (!session) return html`<main class="page"><p>loading…</p></main>`;
  const { parts, params } = route(hash);
  let page;
  let active = parts[0] || "overview";
  if (parts[0] === "sandboxes" && parts[1]) {
    page = html`<${SandboxPage} id=${decodeURIComponent(parts[1])} session=${session} />`;
  } else if (parts[0] === "sandboxes") {
    page = html`<${Sandboxes} session=${session} params=${params} />`;
  } else if (parts[0] === "jobs") {
    page = html`<${Jobs} session=${session} />`;
  } else if (parts[0] === "images") {
    page = html`<${Images} session=${session} />`;
  } else {
    active = "overview";
    page = html`<${Overview} session=${session} />`;
  }
  return html`<${Nav} session=${session} active=${active} />
    <main class="page">${page}</main>`;
}

render(html`<${App} />`, document.getElementById("app"));
