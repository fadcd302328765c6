// The server's API as the page calls it: JSON, server-sent events and /metrics.
// The key (for --api-key servers) is asked once and kept in this browser.

const KEY_NAME = "sluice.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }

  static async from(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch {
      // not JSON: the status line says enough
    }
    return new ApiError(response.status, message);
  }
}

export class Api {
  // askKey(reason) resolves to the key a person typed.
  constructor(askKey) {
    this.askKey = askKey;
  }

  headers(json) {
    const headers = json ? { "Content-Type": "application/json" } : {};
    const key = localStorage.getItem(KEY_NAME);
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  // A 401 asks for the key and tries again with it; any other failure is an ApiError.
  async request(method, path, body, signal) {
    for (;;) {
      const response = await fetch(path, {
        method,
        headers: this.headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
      });
      if (response.status === 401) {
        const refused = await ApiError.from(response);
        localStorage.setItem(KEY_NAME, await this.askKey(refused.message));
        continue;
      }
      if (!response.ok) throw await ApiError.from(response);
      return response;
    }
  }

  async json(method, path, body) {
    return (await this.request(method, path, body)).json();
  }

  async *stream(path, body, signal) {
    const response = await this.request("POST", path, body, signal);
    yield* readEvents(response.body);
  }
}

// The JSON payloads of a text/event-stream body, as they arrive.
export async function* readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data && data !== "[DONE]") yield JSON.parse(data);
    }
  }
}

// Prometheus text: each metric's value, summed over its label sets.
export function parseMetrics(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    values.set(match[1], (values.get(match[1]) || 0) + Number(match[3]));
  }
  return values;
}
