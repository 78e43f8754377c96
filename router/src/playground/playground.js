// The playground: a conversation sent to this server's /v1/chat/completions with
// `stream: true`, its server-sent events read from fetch's body as they arrive.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = []; // {role, content} of the conversation so far
let running = null; // the AbortController of the request in flight

/** Adds one message to the transcript; returns the element its text goes in. */
function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role === "error" ? "Error" : role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  item.append(label, content);
  $("transcript").append(item);
  item.scrollIntoView({ block: "end" });
  return content;
}

/** A number field's value, or undefined when it is empty. */
function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

/** The request body: the conversation and the settings that are filled in. */
function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
  };
  const stops = $("stop_sequences").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  const schema = $("json_schema").value.trim();
  if (schema) {
    // A syntax error here is shown to the user before anything is sent.
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "playground", schema: JSON.parse(schema), strict: true },
    };
  }
  return body;
}

/** The error message of a failed response, in whichever API's shape it came. */
async function errorMessage(response) {
  const text = await response.text();
  try {
    const parsed = JSON.parse(text);
    const error = parsed.error;
    return (error && (error.message || error)) || parsed.message || text;
  } catch {
    return text || `${response.status} ${response.statusText}`;
  }
}

/** Yields the JSON of each `data:` event of a server-sent event stream until `[DONE]`. */
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function showStats(usage, started, firstToken, finished) {
  $("prompt-tokens").value = usage ? usage.prompt_tokens : "–";
  $("completion-tokens").value = usage ? usage.completion_tokens : "–";
  $("ttft").value = firstToken ? `${Math.round(firstToken - started)} ms` : "–";
  // Decode speed: the tokens after the first over the time after the first.
  const decoding = (finished - firstToken) / 1000;
  if (usage && firstToken && usage.completion_tokens > 1 && decoding > 0) {
    $("speed").value = `${((usage.completion_tokens - 1) / decoding).toFixed(1)} tokens/s`;
  } else {
    $("speed").value = "–";
  }
}

function setRunning(controller) {
  running = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
  document.body.dataset.state = controller ? "streaming" : "idle";
}

async function send(prompt) {
  conversation.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  let body;
  try {
    body = requestBody();
  } catch (error) {
    conversation.pop();
    addMessage("error", `The JSON schema is not valid JSON: ${error.message}`);
    return;
  }
  const headers = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  const controller = new AbortController();
  setRunning(controller);
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  let answer = "";
  let output = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers,
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    output = addMessage("assistant", "");
    for await (const chunk of events(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (firstToken === null) firstToken = performance.now();
        answer += delta.content;
        output.textContent = answer;
      }
    }
    conversation.push({ role: "assistant", content: answer });
  } catch (error) {
    if (error.name === "AbortError") {
      if (answer) conversation.push({ role: "assistant", content: answer });
    } else {
      conversation.pop();
      addMessage("error", error.message);
    }
  } finally {
    showStats(usage, started, firstToken, performance.now());
    setRunning(null);
  }
}

$("prompt-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (running || !prompt.trim()) return;
  $("prompt").value = "";
  send(prompt);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("prompt-form").requestSubmit();
  }
});

$("stop").addEventListener("click", () => running && running.abort());

$("clear").addEventListener("click", () => {
  if (running) running.abort();
  conversation.length = 0;
  $("transcript").replaceChildren();
  showStats(null, 0, null, 0);
});

// The settings form is never submitted; Enter in a field does nothing.
$("settings").addEventListener("submit", (event) => event.preventDefault());
document.body.dataset.state = "idle";
