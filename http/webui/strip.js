// The engine's state from /metrics (public, no key): running and waiting sequences,
// the KV cache's memory, and tokens generated per second between two readings.

import { parseMetrics } from "./api.js";

const PERIOD_MS = 2000;

function megabytes(bytes) {
  return `${(bytes / 1e6).toFixed(1)} MB`;
}

export function startEngineStrip(strip) {
  const cell = (name) => strip.querySelector(`[data-metric="${name}"]`);
  let previous = null;
  async function read() {
    if (document.hidden) return;
    try {
      const response = await fetch("/metrics");
      if (!response.ok) return;
      const metrics = parseMetrics(await response.text());
      const now = performance.now();
      const generated = metrics.get("sluice_generation_tokens_total") || 0;
      cell("running").textContent = metrics.get("sluice_running_sequences") ?? "–";
      cell("waiting").textContent = metrics.get("sluice_waiting_sequences") ?? "–";
      cell("kv").textContent = megabytes(metrics.get("sluice_kv_cache_usage_bytes") || 0);
      if (previous) {
        const rate = ((generated - previous.generated) * 1000) / (now - previous.now);
        cell("tps").textContent = rate.toFixed(1);
      }
      previous = { generated, now };
    } catch {
      // the server is restarting: the next reading tells
    }
  }
  read();
  return setInterval(read, PERIOD_MS);
}
