// Two real Node clients of Sluice's /v1/responses:
//
//   node tests/node/responses.mjs <base-url-with-/v1> <model> [--tools]
//
// * the official OpenAI SDK: `responses.create` (unary), `responses.stream()` with
//   `finalResponse()` (its accumulator checks the event invariants and throws on a
//   broken stream), `retrieve` and `delete`;
// * the AI SDK (`ai` + `@ai-sdk/open-responses`): `generateText` and `streamText`, and
//   with --tools a `generateText` whose tool the model must call (toolChoice: required).
//
// Prints one JSON line with what it saw; a failure prints {"error": ...} and exits 1.
// tests/test_node_responses.py runs this and checks the results.

import OpenAI from 'openai';
import { VERSION } from 'openai/version';
import { createOpenResponses } from '@ai-sdk/open-responses';
import { generateText, streamText, tool } from 'ai';
import { z } from 'zod';

const baseURL = process.argv[2] ?? process.env.SLUICE_BASE_URL;
const model = process.argv[3] ?? process.env.SLUICE_MODEL;
const withTools = process.argv.includes('--tools');

const QUESTION = 'What is the capital of France?';

async function sdkCreate(client) {
  const response = await client.responses.create({
    model,
    input: QUESTION,
    temperature: 0,
    max_output_tokens: 24,
  });
  const retrieved = await client.responses.retrieve(response.id);
  await client.responses.delete(response.id);
  let gone = null;
  try {
    await client.responses.retrieve(response.id);
  } catch (err) {
    gone = err.status ?? String(err);
  }
  return {
    id: response.id,
    status: response.status,
    output_text: response.output_text,
    items: response.output.map((item) => item.type),
    usage: response.usage,
    retrieved_text: retrieved.output_text,
    after_delete: gone,
  };
}

async function sdkStream(client) {
  const stream = client.responses.stream({
    model,
    input: QUESTION,
    temperature: 0,
    max_output_tokens: 24,
  });
  const types = [];
  let text = '';
  for await (const event of stream) {
    types.push(event.type);
    if (event.type === 'response.output_text.delta') text += event.delta;
  }
  const final = await stream.finalResponse();
  return { types, delta_text: text, final_text: final.output_text, status: final.status };
}

async function aiSdk() {
  const provider = createOpenResponses({ name: 'sluice', url: `${baseURL}/responses` });
  const generated = await generateText({
    model: provider(model),
    prompt: QUESTION,
    temperature: 0,
    maxOutputTokens: 24,
  });
  const streamed = streamText({
    model: provider(model),
    prompt: QUESTION,
    temperature: 0,
    maxOutputTokens: 24,
  });
  let streamedText = '';
  for await (const part of streamed.textStream) streamedText += part;
  const result = {
    text: generated.text,
    finish_reason: generated.finishReason,
    usage: generated.usage,
    stream_text: streamedText,
    stream_finish_reason: await streamed.finishReason,
  };
  if (withTools) {
    const called = await generateText({
      model: provider(model),
      prompt: 'What is the weather in Paris? Use the tool.',
      temperature: 0,
      maxOutputTokens: 64,
      toolChoice: 'required',
      tools: {
        get_weather: tool({
          description: 'The current weather in a city',
          inputSchema: z.object({ city: z.string() }),
        }),
      },
    });
    result.tool_calls = called.toolCalls.map((call) => ({
      name: call.toolName,
      input: call.input,
      id: call.toolCallId,
    }));
    result.tool_finish_reason = called.finishReason;
  }
  return result;
}

try {
  const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0 });
  const results = {
    sdk_version: VERSION,
    create: await sdkCreate(client),
    stream: await sdkStream(client),
    ai_sdk: await aiSdk(),
  };
  console.log(JSON.stringify(results));
} catch (err) {
  console.log(JSON.stringify({ error: String(err?.stack ?? err) }));
  process.exit(1);
}
