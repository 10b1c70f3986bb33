// Conversations, kept in the browser's IndexedDB (one record per conversation, its messages
// inside), and the settings in localStorage. Nothing is sent to the server but the requests.

const DB_NAME = "tianxia-webui";
const STORE = "conversations";
const SETTINGS_ITEM = "tianxia.settings";
export const EXPORT_FORMAT = "tianxia-webui-conversations";

let dbPromise = null;

function db() {
  if (!dbPromise) {
    dbPromise = new Promise((resolve, reject) => {
      const req = indexedDB.open(DB_NAME, 1);
      req.onupgradeneeded = () => req.result.createObjectStore(STORE, { keyPath: "id" });
      req.onsuccess = () => resolve(req.result);
      req.onerror = () => reject(req.error);
    });
  }
  return dbPromise;
}

async function run(mode, fn) {
  const conn = await db();
  return new Promise((resolve, reject) => {
    const tx = conn.transaction(STORE, mode);
    const req = fn(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(req ? req.result : undefined);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

/** Every conversation, the most recently updated first. */
export async function listConversations() {
  const all = await run("readonly", (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

export function getConversation(id) {
  return run("readonly", (s) => s.get(id));
}

export function putConversation(conv) {
  // a structured clone of plain data: drop anything the UI hung on it
  return run("readwrite", (s) => s.put(JSON.parse(JSON.stringify(conv))));
}

export function deleteConversation(id) {
  return run("readwrite", (s) => s.delete(id));
}

export function newConversation() {
  const now = Date.now();
  // not crypto.randomUUID(): that exists only in secure contexts, and the page may be plain http
  const id = `${now.toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
  return { id, title: "", created: now, updated: now, messages: [] };
}

/** The export file's content: `{format, version, exported, conversations}`. */
export async function exportAll() {
  return {
    format: EXPORT_FORMAT,
    version: 1,
    exported: new Date().toISOString(),
    conversations: await listConversations(),
  };
}

function validConversation(c) {
  return (
    c && typeof c === "object" && typeof c.id === "string" && Array.isArray(c.messages) &&
    c.messages.every((m) => m && typeof m.role === "string" && typeof m.content === "string")
  );
}

/**
 * Import an export file (or one conversation, or a list of them); a conversation with an id
 * already here replaces it. Returns how many were imported; throws on a file of another shape.
 */
export async function importData(data) {
  let list = data;
  if (data && data.format === EXPORT_FORMAT) list = data.conversations;
  else if (data && !Array.isArray(data)) list = [data];
  if (!Array.isArray(list) || !list.every(validConversation)) {
    throw new Error("not a conversation export: expected {format, conversations: [{id, messages}]}");
  }
  for (const c of list) {
    const now = Date.now();
    await putConversation({ title: "", created: now, updated: now, ...c });
  }
  return list.length;
}

export const DEFAULT_SETTINGS = {
  model: "",
  system: "",
  temperature: "",
  top_p: "",
  top_k: "",
  min_p: "",
  max_tokens: "",
  seed: "",
  response_format: "text", // text | json_object | json_schema
  json_schema: "",
  tools: "",
  tool_choice: "auto",
  mode: "chat", // chat | completion
  completion_prompt: "",
};

export function loadSettings() {
  try {
    return { ...DEFAULT_SETTINGS, ...JSON.parse(localStorage.getItem(SETTINGS_ITEM) || "{}") };
  } catch {
    return { ...DEFAULT_SETTINGS };
  }
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS_ITEM, JSON.stringify(settings));
}
