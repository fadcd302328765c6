// Smoke test of a running Sluice server with the official OpenAI Node SDK.
//
//   node tests/node/smoke.mjs <base-url-with-/v1> <model>
//   (or SLUICE_BASE_URL / SLUICE_MODEL in the environment)
//
// Runs a greedy chat call, the same chat through the SDK's ChatCompletionStream helper
// (`client.chat.completions.stream()` + `finalChatCompletion()`, which throws on a
// missing role or finish_reason), a legacy completion and the models list. Prints one
// JSON line with what it saw; any failure prints {"error": ...} and exits with 1.
// tests/test_node_sdk.py runs this and checks the results.

import OpenAI from 'openai';
import { VERSION } from 'openai/version';

const baseURL = process.argv[2] ?? process.env.SLUICE_BASE_URL;
const model = process.argv[3] ?? process.env.SLUICE_MODEL;

const MESSAGES = [{ role: 'user', content: 'What is the capital of France?' }];
const CHAT = { model, messages: MESSAGES, temperature: 0, max_completion_tokens: 24 };

async function chatUnary(client) {
  const completion = await client.chat.completions.create(CHAT);
  const [choice] = completion.choices;
  return {
    id: completion.id,
    object: completion.object,
    choices: completion.choices.length,
    role: choice.message.role,
    content: choice.message.content,
    refusal: choice.message.refusal,
    finish_reason: choice.finish_reason,
    usage: completion.usage,
  };
}

async function chatStream(client) {
  const stream = client.chat.completions.stream({
    ...CHAT,
    n: 2,
    stream_options: { include_usage: true },
  });
  const deltas = { 0: '', 1: '' };
  const roles = { 0: 0, 1: 0 };
  const finishes = { 0: 0, 1: 0 };
  const ids = new Set();
  let chunks = 0;
  let usageChunks = 0;
  stream.on('chunk', (chunk) => {
    chunks += 1;
    ids.add(chunk.id);
    if (chunk.choices.length === 0 && chunk.usage) usageChunks += 1;
    for (const choice of chunk.choices) {
      if (choice.delta.role !== undefined) roles[choice.index] += 1;
      if (choice.finish_reason) finishes[choice.index] += 1;
      deltas[choice.index] += choice.delta.content ?? '';
    }
  });
  // The helper's own accumulation, as its 'content' event reports it (any choice).
  let contentEvents = 0;
  let lastSnapshot = null;
  stream.on('content', (_delta, snapshot) => {
    contentEvents += 1;
    lastSnapshot = snapshot;
  });
  // Throws if a choice lacks its role or finish_reason.
  const final = await stream.finalChatCompletion();
  return {
    ids: [...ids],
    chunks,
    usage_chunks: usageChunks,
    role_chunks: [roles[0], roles[1]],
    finish_chunks: [finishes[0], finishes[1]],
    delta_text: [deltas[0], deltas[1]],
    content_events: contentEvents,
    last_content_snapshot: lastSnapshot,
    final: {
      id: final.id,
      choices: final.choices.map((c) => ({
        index: c.index,
        role: c.message.role,
        content: c.message.content,
        finish_reason: c.finish_reason,
      })),
      usage: final.usage ?? null,
    },
  };
}

async function completion(client) {
  const result = await client.completions.create({
    model,
    prompt: 'The capital of France is',
    max_tokens: 8,
    temperature: 0,
  });
  const [choice] = result.choices;
  return {
    object: result.object,
    text: choice.text,
    finish_reason: choice.finish_reason,
    usage: result.usage,
  };
}

async function models(client) {
  const ids = [];
  for await (const entry of client.models.list()) ids.push(entry.id);
  return ids;
}

async function main() {
  if (!baseURL || !model) {
    throw new Error('usage: node smoke.mjs <base-url> <model> (or SLUICE_BASE_URL, SLUICE_MODEL)');
  }
  const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120_000 });
  const results = {
    sdk_version: VERSION,
    node_version: process.version,
    chat: await chatUnary(client),
    stream: await chatStream(client),
    completion: await completion(client),
    models: await models(client),
  };
  process.stdout.write(`${JSON.stringify(results)}\n`);
}

main().catch((error) => {
  const detail = { name: error?.name, message: String(error?.message ?? error) };
  if (error?.status !== undefined) detail.status = error.status;
  process.stdout.write(`${JSON.stringify({ error: detail })}\n`);
  process.exit(1);
});
