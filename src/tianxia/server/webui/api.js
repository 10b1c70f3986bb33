// The server's OpenAI-compatible API, as the page calls it: JSON requests and server-sent-event
// streams, each with `Authorization: Bearer KEY` when the user gave a key. URLs are relative to
// the page, so the page works behind a path-prefixing proxy too.

const KEY_ITEM = "tianxia.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

/** An error answer (OpenAI's `{"error": {...}}` body), or an error event inside a stream. */
export class APIError extends Error {
  constructor(status, message, code) {
    super(message);
    this.name = "APIError";
    this.status = status;
    this.code = code || null;
  }
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  let code = null;
  try {
    const body = await resp.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new APIError(resp.status, message, code);
}

/** GET or POST `path` (e.g. "v1/models") and return the parsed JSON answer. */
export async function call(path, body, signal) {
  const resp = await fetch(path, {
    method: body === undefined ? "GET" : "POST",
    headers: headers(body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!resp.ok) throw await errorOf(resp);
  return resp.json();
}

/**
 * POST `body` to `path` with `stream: true` and yield each event's JSON object until
 * `data: [DONE]`. Aborting `signal` closes the connection, which the server takes as the client
 * leaving: it aborts the request and frees its KV blocks.
 */
export async function* stream(path, body, signal) {
  const resp = await fetch(path, {
    method: "POST",
    headers: headers(true),
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!resp.ok) throw await errorOf(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let ended = false; // the server ended the response itself: nothing to cancel
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        ended = true;
        return;
      }
      buffer += value;
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        const data = event
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") {
          // read to the end of the response, which follows at once: cancelling it here would
          // close the connection before the server's last bytes and count as an aborted request
          while (!(await reader.read()).done);
          ended = true;
          return;
        }
        const obj = JSON.parse(data);
        if (obj.error) throw new APIError(obj.error.status || 500, obj.error.message, obj.error.code);
        yield obj;
      }
    }
  } finally {
    if (!ended) reader.cancel().catch(() => {});
  }
}

/** A model's load state from its `/v1/models` entry: a string, llama.cpp's `{value: ...}`, or none. */
export function modelStatus(model) {
  const s = model.status;
  if (!s) return null;
  if (typeof s === "string") return { value: s, reason: model.reason || model.error || null };
  return { value: s.value || s.status || "", reason: s.reason || s.error || null };
}
