// The chat page of `jvllm serve`: streams /v1/chat/completions, keeps the conversation in the page.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // OpenAI chat messages, the system message excluded
let image = null;          // a data: URL attached to the next message
let controller = null;     // aborts the reply being streamed
let lastTokens = null;     // for the tok/s of the status line

for (const id of ["system", "temperature", "top_p", "max_tokens", "api_key"]) {
  const saved = localStorage.getItem("jvllm." + id);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => localStorage.setItem("jvllm." + id, $(id).value));
}

function headers() {
  const key = $("api_key").value.trim();
  return Object.assign({"Content-Type": "application/json"}, key ? {"Authorization": "Bearer " + key} : {});
}

function showError(text) { $("error").textContent = text || ""; }

async function errorText(reply) {
  try {
    const body = await reply.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return "HTTP " + reply.status;
  }
}

async function loadModel() {
  const reply = await fetch("v1/models", {headers: headers()});
  if (!reply.ok) {
    $("model").textContent = "";
    showError(reply.status === 401 ? "The server needs an API key: enter it under Settings." : await errorText(reply));
    return null;
  }
  showError("");
  const model = (await reply.json()).data[0].id;
  $("model").textContent = model;
  return model;
}

function addTurn(role, text, imageUrl) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.textContent = text;
  if (imageUrl) {
    const img = document.createElement("img");
    img.src = imageUrl;
    div.appendChild(img);
  }
  $("conversation").appendChild(div);
  $("conversation").scrollTop = $("conversation").scrollHeight;
  return div;
}

function requestMessages() {
  const system = $("system").value.trim();
  return (system ? [{role: "system", content: system}] : []).concat(conversation);
}

async function send(text) {
  const model = $("model").textContent || await loadModel();
  if (!model) return;
  const content = image ? [{type: "text", text: text}, {type: "image_url", image_url: {url: image}}] : text;
  conversation.push({role: "user", content: content});
  addTurn("user", text, image);
  image = null;
  $("attach").value = "";
  $("attached").textContent = "";
  const turn = addTurn("assistant", "");
  turn.classList.add("streaming");
  controller = new AbortController();
  $("stop").hidden = false;
  $("send").disabled = true;
  let reply = "";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({model: model, messages: requestMessages(), stream: true,
                            temperature: Number($("temperature").value), top_p: Number($("top_p").value),
                            max_tokens: Number($("max_tokens").value)}),
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, {stream: true});
      const lines = buffered.split("\n");
      buffered = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = JSON.parse(line.slice(6));
        if (event.error) throw new Error(event.error.message);
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (delta && delta.content) {
          reply += delta.content;
          turn.textContent = reply;
          $("conversation").scrollTop = $("conversation").scrollHeight;
        }
      }
    }
    showError("");
  } catch (error) {
    if (error.name !== "AbortError") showError(String(error.message || error));
  } finally {
    turn.classList.remove("streaming");
    turn.dataset.done = "true";
    conversation.push({role: "assistant", content: reply});
    controller = null;
    $("stop").hidden = true;
    $("send").disabled = false;
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || controller) return;
  $("message").value = "";
  send(text);
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("conversation").textContent = "";
});
$("attach").addEventListener("change", () => {
  const file = $("attach").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => { image = reader.result; $("attached").textContent = file.name; };
  reader.readAsDataURL(file);
});
$("api_key").addEventListener("change", loadModel);

function metricValue(text, name) {
  let total = null;
  for (const line of text.split("\n")) {
    if (line.startsWith(name + "{") || line.startsWith(name + " ")) {
      total = (total || 0) + Number(line.slice(line.lastIndexOf(" ") + 1));
    }
  }
  return total;
}

async function pollStatus() {
  try {
    const text = await (await fetch("metrics")).text();
    const running = metricValue(text, "jvllm:num_requests_running");
    const waiting = metricValue(text, "jvllm:num_requests_waiting");
    const tokens = metricValue(text, "jvllm:generation_tokens_total");
    const rate = lastTokens === null || tokens === null ? 0 : (tokens - lastTokens) / 2;
    lastTokens = tokens;
    $("status").textContent = `running ${running ?? "?"} · waiting ${waiting ?? "?"} · ${rate.toFixed(1)} tok/s`;
  } catch (_) {
    $("status").textContent = "status: server unreachable";
  }
}

loadModel();
pollStatus();
setInterval(pollStatus, 2000);
