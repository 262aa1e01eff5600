// dspark serve's page: a chat that marks each streamed token by origin, and the server's live
// speculative statistics. Model output is untrusted: it is only ever written with textContent
// and as attribute values, never parsed as HTML.
"use strict";

const KIND_LABEL = {
  accepted: "drafted, accepted by the target",
  lookup: "copied from the prompt or the answer so far (lookup), accepted by the target",
  corrected: "the target's token where the draft's was rejected",
  bonus: "the target's bonus token after every verified draft was accepted",
  plain: "a plain target step (no draft)",
};
const $ = (id) => document.getElementById(id);
const history = [];
let busy = false;

function key() { return sessionStorage.getItem("dspark-key") || ""; }

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (key()) h["Authorization"] = "Bearer " + key();
  return h;
}

function status(text) { $("status").textContent = text || ""; }

async function api(path) {
  const r = await fetch(path, { headers: headers(false) });
  if (r.status === 401) {
    $("keyform").hidden = false;
    throw new Error("this server needs its API key: type it above");
  }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

function message(role) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "assistant";
  const body = document.createElement("div");
  body.className = "body";
  box.append(who, body);
  $("log").append(box);
  return box;
}

function tokenTitle(m) {
  let t = KIND_LABEL[m.kind] + " · step " + m.step;
  if (m.slot) t += " · slot " + m.slot;
  if (m.confidence !== undefined) t += " · draft confidence " + m.confidence.toFixed(2);
  const by = m.source === "lookup" ? "the lookup" : "the draft";
  if (m.kind === "corrected" && m.draft_text !== undefined) t += " · " + by + " wrote " + JSON.stringify(m.draft_text);
  return t;
}

function addTokens(body, marks, counts) {
  for (const m of marks) {
    const span = document.createElement("span");
    span.className = "tok " + m.kind;
    span.textContent = m.text;
    span.title = tokenTitle(m);
    span.dataset.kind = m.kind;
    span.dataset.step = m.step;
    span.dataset.slot = m.slot;
    if (m.confidence !== undefined) span.dataset.confidence = m.confidence;
    body.append(span);
    counts[m.kind] = (counts[m.kind] || 0) + 1;
  }
}

function summarize(box, counts, spec) {
  const line = document.createElement("div");
  line.className = "summary";
  const n = Object.values(counts).reduce((a, b) => a + b, 0);
  const parts = ["accepted", "lookup", "corrected", "bonus", "plain"].map((k) => (counts[k] || 0) + " " + k);
  let text = n + " tokens: " + parts.join(", ");
  if (spec) {
    text += " · " + spec.verify_steps + " drafting steps, " + spec.plain_steps + " plain";
    if (spec.verify_steps) text += " · mean acceptance length " + spec.mean_accept_length.toFixed(2);
  }
  line.textContent = text;
  box.append(line);
}

// Server-sent events from a fetch body: "data: {...}\n\n" records
async function* events(response) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const rec = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of rec.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

async function send(text) {
  if (busy || !text.trim()) return;
  busy = true;
  $("send").disabled = true;
  status("");
  message("user").querySelector(".body").textContent = text;
  history.push({ role: "user", content: text });
  const box = message("assistant");
  const body = box.querySelector(".body");
  const counts = {};
  let answer = "", spec = null;
  const req = {
    model: $("model").dataset.id || undefined,
    messages: history,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: parseInt($("max_tokens").value, 10) || undefined,
    temperature: parseFloat($("temperature").value) || 0,
    dspark: { marks: true },
  };
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(req) });
    if (!r.ok) {
      let why = "HTTP " + r.status;
      try { why = (await r.json()).error.message; } catch (e) { /* not JSON */ }
      if (r.status === 401) $("keyform").hidden = false;
      throw new Error(why);
    }
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const obj = JSON.parse(data);
      if (obj.error) throw new Error(obj.error.message);
      const choice = obj.choices && obj.choices[0];
      const marks = obj.dspark && obj.dspark.tokens;
      if (marks) {
        addTokens(body, marks, counts);
      } else if (choice && choice.delta && choice.delta.content) {
        body.append(document.createTextNode(choice.delta.content));
      }
      if (choice && choice.delta && choice.delta.content) answer += choice.delta.content;
      if (obj.speculative) spec = obj.speculative;
    }
    history.push({ role: "assistant", content: answer });
    box.dataset.text = answer;
    if (spec) box.dataset.spec = JSON.stringify(spec);
    summarize(box, counts, spec);
  } catch (err) {
    box.classList.add("error");
    const e = document.createElement("div");
    e.className = "body";
    e.textContent = String(err.message || err);
    box.append(e);
    history.pop();
  } finally {
    busy = false;
    $("send").disabled = false;
    await refreshStats();  // the answer's own steps in the panel at once, not at the next poll
    box.dataset.done = "1";
  }
}

function fmt(x, digits) { return x === null || x === undefined ? "-" : Number(x).toFixed(digits); }

function showStats(s) {
  $("s_rate").textContent = fmt(s.tokens_per_s, 1);
  $("s_mal").textContent = s.speculative && s.verify_steps ? fmt(s.mean_accept_length, 2) : "-";
  $("s_share").textContent = s.drafted_share === null ? "-" : Math.round(100 * s.drafted_share) + " %";
  $("s_tokens").textContent = s.generated_tokens;
  const look = s.lookup;
  $("s_lookup").textContent = !look ? "off" : look.verify_steps + " steps, " + look.accepted_tokens + " of "
    + look.verified_tokens + " tokens accepted";
  $("s_running").textContent = s.running;
  const box = $("s_positions");
  box.replaceChildren();
  (s.conditional_accept_rates || []).forEach((rate, i) => {
    const row = document.createElement("div");
    row.className = "bar";
    const label = document.createElement("span");
    label.textContent = "slot " + (i + 1);
    const track = document.createElement("span");
    track.className = "track";
    const fill = document.createElement("span");
    fill.className = "fill";
    fill.style.display = "block";
    fill.style.width = Math.round(100 * rate) + "%";
    track.append(fill);
    const val = document.createElement("span");
    val.textContent = fmt(rate, 2);
    row.append(label, track, val);
    box.append(row);
  });
  $("s_policy").textContent = !s.speculative ? "no draft loaded: plain decoding"
    : (s.policy_line || s.policy + ": drafts every step");
}

async function refreshStats() {
  try {
    showStats(await api("/v1/dspark/stats"));
  } catch (err) {
    status(String(err.message || err));
  }
}

async function poll() {
  await refreshStats();
  setTimeout(poll, 1000);
}

async function start() {
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("dspark-key", $("key").value);
    $("keyform").hidden = true;
    status("");
    models();
  });
  $("ask").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("ask").requestSubmit(); }
  });
  $("clear").addEventListener("click", () => { history.length = 0; $("log").replaceChildren(); });
  await models();
  poll();
}

async function models() {
  try {
    const m = await api("/v1/models");
    const card = m.data[0];
    $("model").textContent = card.id + (card.speculative ? " + draft" : " (no draft)");
    $("model").dataset.id = card.id;
  } catch (err) {
    status(String(err.message || err));
  }
}

window.dspark = { send };
start();
