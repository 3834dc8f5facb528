// The tierlm dashboard: five tabs over /admin/api (and /v1 for the chat), polled
// while their tab is shown. The session is an HTTP-only cookie: no key here.
"use strict";

const $ = (id) => document.getElementById(id);
const el = (tag, attrs = {}, ...children) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined) e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
};
const SVG = "http://www.w3.org/2000/svg";
const svg = (tag, attrs = {}, text) => {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
const bytes = (n) => {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
};
const fmt = (x, digits = 1) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits));
const ms = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(0) + " ms");

async function api(path, options = {}) {
  const r = await fetch(path, { credentials: "same-origin", ...options,
    headers: { "Content-Type": "application/json", ...(options.headers || {}) } });
  if (r.status === 401) { location.href = "/admin/login"; throw new Error("logged out"); }
  let body = null;
  try { body = await r.json(); } catch (e) { /* not JSON */ }
  if (!r.ok) throw new Error((body && body.error && body.error.message) || "HTTP " + r.status);
  return body;
}

// ---- tabs -------------------------------------------------------------------------
const tabs = {};
let current = null;
function show(name) {
  if (!tabs[name]) name = "status";
  if (current && tabs[current].leave) tabs[current].leave();
  current = name;
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t.id === "tab-" + name));
  document.querySelectorAll("#tabs a").forEach((a) => a.classList.toggle("active", a.dataset.tab === name));
  if (tabs[name].enter) tabs[name].enter();
}
window.addEventListener("hashchange", () => show(location.hash.slice(1)));

function poller(fn, every) {
  let timer = null, on = false;
  const tick = async () => {
    if (!on) return;
    try { await fn(); } catch (e) { console.warn(e); }
    if (on) timer = setTimeout(tick, every);
  };
  return { start() { if (!on) { on = true; tick(); } }, stop() { on = false; clearTimeout(timer); } };
}

// ---- status -----------------------------------------------------------------------
const rateHistory = [];
let previous = null, lastTTFT = null;
async function pollStatus() {
  const s = await api("/admin/api/status");
  $("st-running").textContent = s.running;
  $("st-waiting").textContent = s.waiting;
  const generated = s.engines.reduce((a, e) => a + e.generated_tokens, 0);
  const ttftSum = s.engines.reduce((a, e) => a + e.ttft_sum_s, 0);
  const ttftCount = s.engines.reduce((a, e) => a + e.ttft_count, 0);
  if (previous) {
    const dt = s.time - previous.time;
    const rate = dt > 0 ? Math.max(0, generated - previous.generated) / dt : 0;
    rateHistory.push(rate);
    if (rateHistory.length > 60) rateHistory.shift();
    $("st-toks").textContent = fmt(rate);
    if (ttftCount > previous.ttftCount) lastTTFT = (ttftSum - previous.ttftSum) / (ttftCount - previous.ttftCount);
  }
  previous = { time: s.time, generated, ttftSum, ttftCount };
  $("st-ttft").textContent = lastTTFT !== null ? ms(lastTTFT) : ttftCount ? ms(ttftSum / ttftCount) : "–";
  const spark = $("st-spark");
  spark.replaceChildren();
  if (rateHistory.length > 1) {
    const top = Math.max(1, ...rateHistory);
    const points = rateHistory.map((v, i) => `${(i * 120) / 59},${30 - (v / top) * 28 - 1}`).join(" ");
    spark.append(svg("polyline", { points }));
  }
  $("st-loaded").textContent = s.models.filter((m) => m.memory_bytes !== null).length + " / " + s.models.length;
  const m = s.memory;
  meter("st-mem-bar", m.used_bytes, m.budget_bytes);
  $("st-mem").textContent = bytes(m.used_bytes) + " of " + bytes(m.budget_bytes);
  meter("st-proc-bar", m.process_bytes, m.hard_mark_bytes, m.soft_mark_bytes);
  $("st-proc").textContent = m.process_bytes === null ? "–" :
    bytes(m.process_bytes) + " (soft " + bytes(m.soft_mark_bytes) + ", hard " + bytes(m.hard_mark_bytes) + ")" + (m.paused ? " · new requests wait" : "");
  const rows = s.engines.map((e) => el("tr", {}, el("td", {}, e.model), el("td", {}, String(e.running ?? 0)),
    el("td", {}, String(e.prefilling ?? 0)), el("td", {}, String(e.waiting ?? 0)), el("td", {}, String(e.generated_tokens)),
    el("td", {}, String(e.prompt_tokens)), el("td", {}, e.degraded ? "degraded: " + e.degraded : e.alive ? "ok" : "stopped")));
  $("st-engines").replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no model loaded"))]));
  const cache = [];
  for (const e of s.engines) {
    for (const [tier, t] of Object.entries(e.cache)) {
      const rate = e.cache_lookup_tokens ? (100 * t.hit_tokens) / e.cache_lookup_tokens : null;
      cache.push(el("tr", {}, el("td", {}, e.model), el("td", {}, tier), el("td", {}, String(t.blocks)),
        el("td", {}, bytes(t.bytes) + " of " + bytes(t.capacity_bytes)), el("td", {}, String(t.hit_tokens)),
        el("td", {}, rate === null ? "–" : fmt(rate) + " %")));
    }
  }
  $("st-cache").replaceChildren(...(cache.length ? cache : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "no cache"))]));
}
function meter(id, value, limit, warnAt) {
  const bar = $(id);
  const frac = value && limit ? Math.min(1, value / limit) : 0;
  bar.style.width = (100 * frac).toFixed(1) + "%";
  bar.className = frac > 0.95 ? "bad" : (warnAt && value > warnAt) || frac > 0.85 ? "warn" : "";
}
const statusPoll = poller(pollStatus, 1000);
tabs.status = { enter: () => statusPoll.start(), leave: () => statusPoll.stop() };

// ---- models -------------------------------------------------------------------------
let modelsCache = [];
async function loadModels() {
  const data = await api("/admin/api/models");
  modelsCache = data.models;
  $("settings-file").textContent = data.settings_file ? "Settings are saved to " + data.settings_file + " (hot-reloaded)." :
    "This server has no settings file: settings cannot be saved.";
  const rows = data.models.map((m) => {
    const busy = m.state === "loading";
    const loaded = m.state === "loaded" || m.state === "pinned";
    const act = (label, fn, opts = {}) => el("button", { class: "small", type: "button", ...opts, onclick: async (ev) => {
      ev.target.disabled = true;
      try { await fn(); } catch (e) { alert(e.message); }
      await loadModels();
    } }, label);
    return el("tr", { "data-model": m.name },
      el("td", {}, m.name + (m.default ? " (default)" : "")), el("td", {}, bytes(m.size_bytes)), el("td", {}, String(m.context_length)),
      el("td", {}, m.quantization || "float"), el("td", {}, el("span", { class: "state state-" + m.state }, m.state)),
      el("td", {}, bytes(m.memory_bytes)), el("td", {}, String(m.in_flight)),
      el("td", {}, m.expires_in_s === null ? "–" : fmt(m.expires_in_s, 0) + " s"),
      el("td", { class: "actions" },
        loaded ? act("Unload", () => api(`/admin/api/models/${encodeURIComponent(m.name)}/unload`, { method: "POST" }),
          { disabled: m.pinned ? "" : null, "data-action": "unload" })
          : act(busy ? "Loading…" : "Load", () => api(`/admin/api/models/${encodeURIComponent(m.name)}/load`, { method: "POST" }),
            { disabled: busy ? "" : null, "data-action": "load" }),
        act(m.pinned ? "Unpin" : "Pin", () => api(`/admin/api/models/${encodeURIComponent(m.name)}/pin`,
          { method: "POST", body: JSON.stringify({ pinned: !m.pinned }) }), { disabled: m.default ? "" : null, "data-action": "pin" }),
        el("button", { class: "small", type: "button", "data-action": "settings", onclick: () => openSettings(m) }, "Settings")));
  });
  $("models-body").replaceChildren(...rows);
}
function openSettings(m) {
  $("model-settings").hidden = false;
  $("ms-name").textContent = m.name;
  $("ms-msg").textContent = "";
  const form = $("ms-form");
  form.dataset.model = m.name;
  for (const input of form.querySelectorAll("input")) {
    const v = m.settings[input.name];
    input.value = v === undefined || v === null ? "" : Array.isArray(v) ? v.join(", ") : v;
  }
}
$("ms-close").addEventListener("click", () => { $("model-settings").hidden = true; });
$("ms-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const form = ev.target, body = {};
  for (const input of form.querySelectorAll("input")) {
    const v = input.value.trim();
    body[input.name] = v === "" ? null : input.type === "number" ? Number(v) : v;
  }
  try {
    const r = await api(`/admin/api/models/${encodeURIComponent(form.dataset.model)}/settings`, { method: "PUT", body: JSON.stringify(body) });
    $("ms-msg").textContent = "saved" + (r.overridden_by_command_line.length ? " (the command line still sets " + r.overridden_by_command_line.join(", ") + ")" : "");
  } catch (e) { $("ms-msg").textContent = e.message; }
  loadModels();
});
$("import-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = new FormData(ev.target);
  const body = { path: f.get("path"), name: f.get("name") || null, bits: f.get("bits") ? Number(f.get("bits")) : null };
  $("import-progress").hidden = false;
  try {
    let job = await api("/admin/api/import", { method: "POST", body: JSON.stringify(body) });
    while (job.state === "running") {
      $("import-bar").style.width = (job.total ? (100 * job.done) / job.total : 5) + "%";
      $("import-text").textContent = job.stage + (job.total ? ` ${job.done}/${job.total}` : "");
      await new Promise((r) => setTimeout(r, 500));
      job = await api("/admin/api/import/" + job.id);
    }
    $("import-bar").style.width = "100%";
    $("import-text").textContent = job.state === "done" ? "imported " + job.name : "failed: " + job.error;
  } catch (e) { $("import-text").textContent = e.message; }
  loadModels();
});
const modelsPoll = poller(loadModels, 3000);
tabs.models = { enter: () => modelsPoll.start(), leave: () => modelsPoll.stop() };

// ---- chat -------------------------------------------------------------------------------
const chat = { messages: [], controller: null };
async function fillModelSelect(select) {
  const data = await api("/v1/models");
  const keep = select.value;
  select.replaceChildren(...data.data.map((m) => el("option", { value: m.id }, m.id + (m.state === "available" ? " (not loaded)" : ""))));
  if (keep && data.data.some((m) => m.id === keep)) select.value = keep;
}
function addMessage(role, text) {
  const body = el("div", { class: "body" });
  const node = el("div", { class: "msg " + role }, el("div", { class: "who" }, role), body);
  if (role === "user") body.textContent = text;
  $("chat-log").append(node);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return node;
}
async function send(text) {
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const node = addMessage("assistant", "");
  const body = node.querySelector(".body");
  let content = "", reasoning = "", details = null, drawn = false, finish = null;
  const draw = () => {
    drawn = false;
    if (reasoning) {
      if (!details) { details = el("details", { class: "reasoning", open: "" }, el("summary", {}, "reasoning"), el("div", { class: "text" })); node.insertBefore(details, body); }
      details.querySelector(".text").textContent = reasoning;
    }
    body.innerHTML = TierMD.render(content); // escaped by the renderer
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
  };
  const later = () => { if (!drawn) { drawn = true; requestAnimationFrame(draw); } };
  chat.controller = new AbortController();
  $("chat-stop").disabled = false; $("chat-send").disabled = true;
  node.dataset.state = "streaming";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", credentials: "same-origin", signal: chat.controller.signal,
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: $("chat-model").value, messages: chat.messages, stream: true,
        max_tokens: Number($("chat-max").value) || 512, temperature: Number($("chat-temp").value) }),
    });
    if (!r.ok) {
      let msg = "HTTP " + r.status;
      try { msg = (await r.json()).error.message; } catch (e) { /* keep */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "error");
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const d = choice.delta || {};
        if (d.content) content += d.content;
        if (d.reasoning_content) reasoning += d.reasoning_content;
        if (choice.finish_reason) finish = choice.finish_reason;
        later();
      }
    }
    node.dataset.state = "done";
    node.append(el("div", { class: "note" }, finish ? "finished: " + finish : ""));
  } catch (e) {
    if (e.name === "AbortError") {
      node.dataset.state = "stopped";
      node.append(el("div", { class: "note" }, "stopped"));
    } else {
      node.dataset.state = "error";
      node.classList.add("error");
      content += (content ? "\n\n" : "") + "Error: " + e.message;
    }
  } finally {
    draw();
    if (content) chat.messages.push({ role: "assistant", content });
    chat.controller = null;
    $("chat-stop").disabled = true; $("chat-send").disabled = false;
  }
}
$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("chat-text").value.trim();
  if (!text || chat.controller) return;
  $("chat-text").value = "";
  send(text);
});
$("chat-text").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("chat-stop").addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
$("chat-clear").addEventListener("click", () => { if (chat.controller) chat.controller.abort(); chat.messages = []; $("chat-log").replaceChildren(); });
tabs.chat = { enter: () => fillModelSelect($("chat-model")).catch(console.warn) };

// ---- benchmark ------------------------------------------------------------------------
function plotBench(results) {
  const plot = $("bench-plot");
  plot.replaceChildren();
  const W = 640, H = 300, L = 60, R = 60, T = 24, B = 44;
  const xs = results.map((r) => r.concurrency);
  if (!xs.length) return;
  const toks = results.map((r) => r.output_tok_s || 0), ttft = results.map((r) => (r.ttft_mean_s || 0) * 1000);
  const maxT = Math.max(1, ...toks) * 1.15, maxF = Math.max(1, ...ttft) * 1.15;
  const n = xs.length;
  const x = (i) => (n === 1 ? L + (W - L - R) / 2 : L + (i * (W - L - R)) / (n - 1));
  const y1 = (v) => H - B - (v / maxT) * (H - T - B), y2 = (v) => H - B - (v / maxF) * (H - T - B);
  for (let k = 0; k <= 4; k++) {
    const yy = T + (k * (H - T - B)) / 4;
    plot.append(svg("line", { x1: L, x2: W - R, y1: yy, y2: yy, class: "gridline" }));
    plot.append(svg("text", { x: L - 6, y: yy + 4, "text-anchor": "end", class: "t1" }, fmt(maxT * (1 - k / 4), 0)));
    plot.append(svg("text", { x: W - R + 6, y: yy + 4, class: "t2" }, fmt(maxF * (1 - k / 4), 0)));
  }
  plot.append(svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  xs.forEach((c, i) => plot.append(svg("text", { x: x(i), y: H - B + 16, "text-anchor": "middle" }, String(c))));
  plot.append(svg("text", { x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle" }, "concurrency"));
  plot.append(svg("text", { x: L, y: 14, class: "t1" }, "output tok/s"));
  plot.append(svg("text", { x: W - R, y: 14, "text-anchor": "end", class: "t2" }, "TTFT ms (dashed)"));
  plot.append(svg("polyline", { class: "s1", points: toks.map((v, i) => `${x(i)},${y1(v)}`).join(" ") }));
  plot.append(svg("polyline", { class: "s2", points: ttft.map((v, i) => `${x(i)},${y2(v)}`).join(" ") }));
  toks.forEach((v, i) => plot.append(svg("circle", { cx: x(i), cy: y1(v), r: 4, class: "p1" })));
  ttft.forEach((v, i) => plot.append(svg("circle", { cx: x(i), cy: y2(v), r: 4, class: "p2" })));
  plot.dataset.points = String(n);
}
function benchTable(results) {
  $("bench-body").replaceChildren(...results.map((r) => el("tr", {}, el("td", {}, String(r.concurrency)),
    el("td", {}, String(r.requests)), el("td", {}, String(r.failed)), el("td", {}, fmt(r.output_tok_s)),
    el("td", {}, ms(r.ttft_mean_s)), el("td", {}, ms(r.ttft_p50_s)), el("td", {}, fmt(r.duration_s) + " s"))));
}
$("bench-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = new FormData(ev.target);
  const body = { model: f.get("model"), concurrencies: String(f.get("concurrencies")).split(",").map((s) => Number(s.trim())).filter((v) => v > 0),
    max_tokens: Number(f.get("max_tokens")), requests: Number(f.get("requests")) };
  $("bench-run").disabled = true;
  $("bench-msg").textContent = "running…";
  $("bench-plot").dataset.state = "running";
  try {
    let job = await api("/admin/api/bench", { method: "POST", body: JSON.stringify(body) });
    for (;;) {
      benchTable(job.results); plotBench(job.results);
      if (job.state !== "running") break;
      await new Promise((r) => setTimeout(r, 700));
      job = await api("/admin/api/bench/" + job.id);
    }
    $("bench-msg").textContent = job.state === "done" ? "done" : "failed: " + job.error;
    $("bench-plot").dataset.state = job.state;
  } catch (e) { $("bench-msg").textContent = e.message; $("bench-plot").dataset.state = "failed"; }
  $("bench-run").disabled = false;
});
tabs.bench = { enter: () => fillModelSelect($("bench-model")).catch(console.warn) };

// ---- logs -----------------------------------------------------------------------------
let logAfter = 0;
const logLines = [];
async function pollLogs() {
  const data = await api("/admin/api/logs?after=" + logAfter);
  logAfter = data.next;
  if (!data.lines.length) return;
  logLines.push(...data.lines.map((l) => l.text));
  if (logLines.length > 3000) logLines.splice(0, logLines.length - 3000);
  drawLogs();
}
function drawLogs() {
  const view = $("log-view"), filter = $("log-filter").value.toLowerCase();
  const lines = filter ? logLines.filter((l) => l.toLowerCase().includes(filter)) : logLines;
  view.replaceChildren(...lines.slice(-1500).map((l) => {
    const level = (l.match(/^\S+ (\w+)/) || [])[1] || "";
    return el("div", { class: "lvl-" + level }, l);
  }));
  if ($("log-follow").checked) view.scrollTop = view.scrollHeight;
}
$("log-filter").addEventListener("input", drawLogs);
const logsPoll = poller(pollLogs, 1000);
tabs.logs = { enter: () => logsPoll.start(), leave: () => logsPoll.stop() };

// ---- header ---------------------------------------------------------------------------
$("logout").addEventListener("click", async () => {
  await fetch("/admin/logout", { method: "POST", credentials: "same-origin" });
  location.href = "/admin/login";
});
$("theme").addEventListener("click", () => {
  const order = ["system", "light", "dark"];
  const now = localStorage.getItem("tierlm-theme") || "system";
  const next = order[(order.indexOf(now) + 1) % order.length];
  localStorage.setItem("tierlm-theme", next);
  if (next === "system") delete document.documentElement.dataset.theme; else document.documentElement.dataset.theme = next;
  $("theme").title = "theme: " + next;
});
api("/admin/api/whoami").then((w) => {
  $("who").textContent = w.open ? "no keys set (loopback)" : "logged in as " + w.key_name;
  if (w.open) $("logout").hidden = true;
}).catch(console.warn);
show(location.hash.slice(1) || "status");
