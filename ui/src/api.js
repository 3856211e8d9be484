// Calls to the dsec API from the page. The session cookie authenticates them (it is
// HttpOnly: this code never sees it, nor the API key); state-changing calls carry the CSRF
// token /ui/api/session gave. A 401 (expired, revoked or forged session) goes back to sign-in.

let csrf = null;

export function setCsrf(token) {
  csrf = token;
}

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function check(r) {
  if (r.status === 401) {
    window.location.assign("/ui");
    throw new ApiError(401, "unauthenticated", "signed out");
  }
  if (!r.ok) {
    let code = "error";
    let message = `${r.status} ${r.statusText}`;
    try {
      const body = await r.json();
      if (body && body.error) {
        code = body.error.code;
        message = body.error.message;
      }
    } catch (_) {
      /* not JSON */
    }
    throw new ApiError(r.status, code, message);
  }
  return r;
}

function headers(method, extra) {
  const h = { ...(extra || {}) };
  if (method !== "GET" && method !== "HEAD" && csrf) h["X-Dsec-CSRF"] = csrf;
  return h;
}

export async function request(method, path, { json, params, signal } = {}) {
  const url = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(params || {})) {
    if (Array.isArray(v)) v.forEach((x) => url.searchParams.append(k, x));
    else if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, v);
  }
  const init = { method, headers: headers(method), credentials: "same-origin", signal };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  }
  return check(await fetch(url, init));
}

export const get = async (path, params) => (await request("GET", path, { params })).json();
export const getText = async (path, params) => (await request("GET", path, { params })).text();
export const post = async (path, json) => {
  const r = await request("POST", path, { json });
  return r.status === 204 ? null : r.json();
};
export const del = async (path) => (await request("DELETE", path)).json();

// NDJSON lines of a streamed answer (logs with follow=true): calls onLine(object) per line
// until the stream ends or `signal` aborts.
export async function streamLines(path, params, onLine, signal) {
  const r = await request("GET", path, { params, signal });
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).trim();
      buf = buf.slice(nl + 1);
      if (line) {
        try {
          onLine(JSON.parse(line));
        } catch (_) {
          /* a malformed line is skipped */
        }
      }
    }
  }
}

export async function signOut() {
  try {
    await request("POST", "/ui/logout");
  } finally {
    window.location.assign("/ui");
  }
}
