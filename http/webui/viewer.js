// A stored response's lifecycle: its event log as a timeline (created → queued →
// in_progress → deltas → tool calls → completed / incomplete / failed / cancelled),
// each event at the time the server logged it, beside the request's parameters and
// its usage. Runs of deltas are drawn as one row with their count and time span.

const DELTA = /\.delta$/;
const PARAMETERS = [
  ["model", (r) => r.model],
  ["instructions", (r) => r.instructions],
  ["temperature", (r) => r.temperature],
  ["top_p", (r) => r.top_p],
  ["max_output_tokens", (r) => r.max_output_tokens],
  ["text.format", (r) => r.text && r.text.format && r.text.format.type],
  ["tools", (r) => (r.tools && r.tools.length ? r.tools.map((t) => t.name || t.type).join(", ") : null)],
  ["previous_response_id", (r) => r.previous_response_id],
  ["background", (r) => r.background],
  ["store", (r) => r.store],
];

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function table(caption, rows) {
  const node = element("table");
  node.append(element("caption", caption));
  for (const [name, value] of rows) {
    const tr = element("tr");
    tr.append(element("th", name), element("td", value === undefined || value === null ? "–" : value));
    node.append(tr);
  }
  return node;
}

function offset(at, start) {
  if (at === null || start === null) return "time not kept";
  return `+${Math.round((at - start) * 1000)} ms`;
}

// Consecutive deltas of one type become one row.
export function timelineRows(logged) {
  const rows = [];
  for (const { at, event } of logged) {
    const last = rows[rows.length - 1];
    if (DELTA.test(event.type) && last && last.type === event.type) {
      last.count += 1;
      last.lastAt = at;
      last.lastSeq = event.sequence_number;
      continue;
    }
    rows.push({ type: event.type, seq: event.sequence_number, lastSeq: event.sequence_number,
                at, lastAt: at, count: 1, event });
  }
  return rows;
}

function describe(row) {
  const { event } = row;
  if (event.type === "response.output_item.done" || event.type === "response.output_item.added") {
    const item = event.item;
    return item.type === "function_call" ? `${item.type} ${item.name}(${item.arguments || ""})` : item.type;
  }
  if (event.type === "error") return event.message;
  if (event.response) return event.response.status;
  return "";
}

export async function showLifecycle(api, responseId, container, backHref) {
  container.replaceChildren(element("p", `Loading ${responseId}…`));
  const [response, log] = await Promise.all([
    api.json("GET", `/v1/responses/${encodeURIComponent(responseId)}`),
    api.json("GET", `/v1/responses/${encodeURIComponent(responseId)}/events`),
  ]);
  const heading = element("h2", "Response lifecycle");
  const back = element("a", "← back to the conversation");
  back.href = backHref;
  const status = element("p", null, "lifecycle-status");
  status.append("Status: ", element("strong", response.status, `status status-${response.status}`));
  status.dataset.status = response.status;
  const created = new Date(response.created_at * 1000).toISOString();
  const summary = element("p", `${response.id} · created ${created}`, "muted");

  const start = log.data.length && log.data[0].at !== null ? log.data[0].at : null;
  const timeline = element("ol", null, "timeline");
  timeline.setAttribute("aria-label", "Events in order");
  for (const row of timelineRows(log.data)) {
    const li = element("li", null, `event ${row.type.replaceAll(".", "-")}`);
    li.dataset.type = row.type;
    const name = row.count > 1 ? `${row.type} × ${row.count}` : row.type;
    const span = row.count > 1 ? `${offset(row.at, start)} … ${offset(row.lastAt, start)}` : offset(row.at, start);
    const seq = row.count > 1 ? `#${row.seq}–${row.lastSeq}` : `#${row.seq}`;
    li.append(element("span", seq, "seq"), element("span", name, "type"),
              element("time", span), element("span", describe(row), "detail"));
    timeline.append(li);
  }
  const terminal = log.data.some(({ event }) => /^response\.(completed|incomplete|failed)$/.test(event.type));
  if (!terminal && response.status === "cancelled") {
    // A cancelled stream has no event for it: it just ends. The stored body says so.
    const li = element("li", null, "event response-cancelled");
    li.dataset.type = "response.cancelled";
    li.append(element("span", "", "seq"), element("span", "cancelled", "type"),
              element("time", "—"), element("span", "the stored response's status", "detail"));
    timeline.append(li);
  }

  const usage = response.usage || {};
  const usageTable = table("Usage", [
    ["input_tokens", usage.input_tokens],
    ["cached_tokens", usage.input_tokens_details && usage.input_tokens_details.cached_tokens],
    ["output_tokens", usage.output_tokens],
    ["reasoning_tokens", usage.output_tokens_details && usage.output_tokens_details.reasoning_tokens],
    ["total_tokens", usage.total_tokens],
  ]);
  const parameters = table("Request", PARAMETERS.map(([name, read]) => [name, read(response)]));
  const facts = element("div", null, "facts");
  facts.append(parameters, usageTable);
  const why = response.error ? element("p", `Error: ${response.error.message}`, "error")
    : response.incomplete_details ? element("p", `Incomplete: ${response.incomplete_details.reason}`, "muted")
    : "";
  container.replaceChildren(back, heading, status, summary, why, facts, element("h3", "Events"), timeline);
  heading.tabIndex = -1;
  heading.focus();
}
