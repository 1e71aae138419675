// The operator console: polls GET /admin/overview with the admin key and draws it; its
// buttons call the admin API. Data goes into the page as text only (tenant names are
// whatever an operator typed), never as markup.
"use strict";

(function () {
  const body = document.body;
  const ROOT = body.dataset.root || "";
  const POLL_MS = Number(body.dataset.pollMs) || 1500;
  const TIERS = (body.dataset.tiers || "").split(",").filter(Boolean);
  const COLORS = { interactive: "#d9480f", standard: "#1971c2", batch: "#2b8a3e" };
  const HISTORY = 120; // points of the depth chart
  const KEY_STORE = "tierq-admin-key";

  const $ = (id) => document.getElementById(id);
  const history = []; // [{at, queued: {tier: n}}]
  let timer = null;
  let busy = false;
  let last = null;
  const armed = new Map(); // button id -> time it was first clicked (confirm by a second click)

  function key() { return sessionStorage.getItem(KEY_STORE) || ""; }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      if (cell instanceof Node) td.appendChild(cell); else td.textContent = cell === null || cell === undefined ? "–" : String(cell);
      tr.appendChild(td);
    }
    return tr;
  }

  function fill(tableId, rows, empty) {
    const tbody = $(tableId).querySelector("tbody");
    tbody.replaceChildren(...rows);
    if (!rows.length) {
      const tr = row([empty]);
      tr.firstChild.colSpan = $(tableId).querySelectorAll("thead th").length;
      tr.className = "empty";
      tbody.appendChild(tr);
    }
  }

  function secs(v) {
    if (v === null || v === undefined) return "–";
    if (v < 1) return (v * 1000).toFixed(0) + " ms";
    if (v < 120) return v.toFixed(v < 10 ? 2 : 1) + " s";
    if (v < 7200) return (v / 60).toFixed(1) + " min";
    return (v / 3600).toFixed(1) + " h";
  }

  function pct(v) { return v === null || v === undefined ? "–" : (v * 100).toFixed(1) + " %"; }

  function triple(p) {
    if (!p || !p.samples) return "no samples";
    return secs(p.p50) + " / " + secs(p.p95) + " / " + secs(p.p99) + "  (" + p.samples + ")";
  }

  function bar(fraction, cls, label) {
    const wrap = el("div", null, "bar " + (cls || ""));
    const fillEl = el("div", null, "fill");
    fillEl.style.width = Math.max(0, Math.min(1, fraction || 0)) * 100 + "%";
    wrap.appendChild(fillEl);
    wrap.appendChild(el("span", label === undefined ? pct(fraction) : label, "label"));
    return wrap;
  }

  function showError(message) {
    const box = $("error");
    box.textContent = message;
    box.hidden = !message;
  }

  async function api(method, path, payload) {
    const init = { method, headers: { Authorization: "Bearer " + key() } };
    if (payload !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(payload);
    }
    const res = await fetch(ROOT + path, init);
    let data = null;
    try { data = await res.json(); } catch (_) { data = null; }
    if (!res.ok) {
      const err = (data && data.error) || {};
      const e = new Error((err.message || res.statusText) + (err.code ? " (" + err.code + ")" : ""));
      e.status = res.status;
      throw e;
    }
    return data;
  }

  // A destructive button acts on its second click within 4 s: the first one arms it.
  function confirmed(button) {
    const at = armed.get(button.id);
    if (at && Date.now() - at < 4000) { armed.delete(button.id); return true; }
    armed.set(button.id, Date.now());
    button.textContent = "Confirm " + button.dataset.label.toLowerCase() + "?";
    button.classList.add("armed");
    return false;
  }

  function actionButton(id, label, onConfirm) {
    const b = el("button", label, "action");
    b.type = "button";
    b.id = id;
    b.dataset.label = label;
    const at = armed.get(id);
    if (at && Date.now() - at < 4000) {
      b.textContent = "Confirm " + label.toLowerCase() + "?";
      b.classList.add("armed");
    }
    b.addEventListener("click", async () => {
      if (!confirmed(b)) return;
      b.disabled = true;
      try { await onConfirm(); showError(""); } catch (e) { showError(label + " failed: " + e.message); }
      await poll();
    });
    return b;
  }

  function drawDepth() {
    const canvas = $("depth-chart");
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height, pad = 24;
    ctx.clearRect(0, 0, w, h);
    let max = 1;
    for (const p of history) for (const t of TIERS) max = Math.max(max, p.queued[t] || 0);
    ctx.strokeStyle = "#ccc";
    ctx.fillStyle = "#666";
    ctx.font = "11px sans-serif";
    ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, h - pad); ctx.lineTo(w - 4, h - pad); ctx.stroke();
    ctx.fillText(String(max), 2, 12);
    ctx.fillText("0", 12, h - pad);
    if (history.length > 1) {
      const t0 = history[0].at, span = Math.max(1, history[history.length - 1].at - t0);
      $("depth-span").textContent = span.toFixed(0);
      TIERS.forEach((tier, i) => {
        ctx.strokeStyle = COLORS[tier] || "#333";
        ctx.lineWidth = 2;
        ctx.beginPath();
        history.forEach((p, j) => {
          const x = pad + ((p.at - t0) / span) * (w - pad - 8);
          const y = h - pad - ((p.queued[tier] || 0) / max) * (h - pad - 8);
          if (j === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
        });
        ctx.stroke();
        ctx.fillStyle = COLORS[tier] || "#333";
        ctx.fillText(tier, pad + 8 + i * 90, h - 6);
      });
    }
  }

  function drawShares(tiers) {
    const canvas = $("share-chart");
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height, left = 80, barH = 28;
    ctx.clearRect(0, 0, w, h);
    ctx.font = "12px sans-serif";
    tiers.forEach((t, i) => {
      const y = 10 + i * (barH + 16);
      const width = w - left - 50;
      ctx.fillStyle = "#eee";
      ctx.fillRect(left, y, width, barH);
      ctx.fillStyle = COLORS[t.tier] || "#333";
      ctx.fillRect(left, y, width * (t.share || 0), barH);
      ctx.fillStyle = "#222";
      ctx.fillText(t.tier, 4, y + 18);
      ctx.fillText(t.share === null ? "–" : (t.share * 100).toFixed(0) + "%", left + width + 6, y + 18);
      if (t.min_share) {
        const x = left + width * t.min_share;
        ctx.strokeStyle = "#000";
        ctx.lineWidth = 2;
        ctx.beginPath(); ctx.moveTo(x, y - 3); ctx.lineTo(x, y + barH + 3); ctx.stroke();
      }
    });
  }

  function renderTiers(o) {
    $("share-window").textContent = String(o.share_window_s);
    fill("tiers", o.tiers.map((t) => {
      const tr = row([
        t.tier, t.queued, t.running, secs(t.oldest_wait_s), triple(t.wait_s), triple(t.ttft_s),
        pct(t.share) + (t.min_share ? " (min " + pct(t.min_share) + ")" : ""), secs(t.slo_s),
      ]);
      tr.dataset.tier = t.tier;
      if (t.min_share && t.share !== null && t.share < t.min_share && t.queued > 0) tr.className = "warn";
      return tr;
    }), "no tiers");
    history.push({ at: o.at, queued: Object.fromEntries(o.tiers.map((t) => [t.tier, t.queued])) });
    while (history.length > HISTORY) history.shift();
    drawDepth();
    drawShares(o.tiers);
  }

  function renderWorkers(o) {
    $("leader").textContent = o.dispatcher_leader ? "· dispatcher leader: " + o.dispatcher_leader : "· no dispatcher leads";
    fill("workers", o.workers.map((w) => {
      const state = !w.alive ? "dead" : !w.engine_ok ? "engine down" : w.draining ? "draining" : "ok";
      const tr = row([w.id, w.capacity, w.running, w.inbox, bar(w.load, "load"), secs(w.heartbeat_age_s) + " ago", state]);
      tr.dataset.worker = w.id;
      if (state !== "ok") tr.className = "warn";
      return tr;
    }), "no worker has sent a heartbeat");
  }

  function renderBatches(o) {
    fill("batches", o.batches.map((b) => {
      const done = b.completed + b.failed;
      const cancellable = b.status === "validating" || b.status === "in_progress";
      const tr = row([
        b.id, b.tenant_id, b.status,
        bar(b.progress, "progress", b.total ? done + " / " + b.total + " (" + pct(b.progress) + ")" : "–"),
        b.completed + " / " + b.failed + " / " + b.total,
        b.lines_per_s === null ? "–" : b.lines_per_s.toFixed(2),
        b.eta_s === null ? "–" : secs(b.eta_s),
        cancellable ? actionButton("cancel-" + b.id, "Cancel", () => api("POST", "/admin/batches/" + encodeURIComponent(b.id) + "/cancel")) : "",
      ]);
      tr.dataset.batch = b.id;
      return tr;
    }), "no batch unfinished or finished within the hour");
  }

  function renderTenants(o) {
    const shown = o.tenants.data.length;
    $("tenant-count").textContent = "· " + shown + " of " + o.tenants.total + " (most tokens this month first)";
    fill("tenants", o.tenants.data.map((t) => {
      const name = el("span");
      name.appendChild(el("strong", t.name));
      name.appendChild(el("br"));
      name.appendChild(el("small", t.id, "muted"));
      const q = t.tightest;
      const quota = q
        ? bar(q.headroom, "headroom", q.limit_name + (q.tier ? " (" + q.tier + ")" : "") + ": " + q.used + " / " + q.limit)
        : el("span", "no limit", "muted");
      const actions = el("span");
      const suspended = t.status === "suspended";
      actions.appendChild(actionButton((suspended ? "resume-" : "suspend-") + t.id, suspended ? "Resume" : "Suspend",
        () => api("POST", "/admin/tenants/" + encodeURIComponent(t.id) + (suspended ? "/resume" : "/suspend"))));
      const edit = el("button", "Quota", "action");
      edit.type = "button";
      edit.id = "quota-" + t.id;
      edit.addEventListener("click", () => openQuota(t));
      actions.appendChild(edit);
      const tr = row([name, t.status, t.month_tokens.toLocaleString(), t.month_cost, t.queued, t.running, quota, actions]);
      tr.dataset.tenant = t.id;
      if (suspended) tr.className = "warn";
      return tr;
    }), "no tenant");
  }

  function renderFailures(o) {
    const codes = Object.entries(o.failures.last_hour_by_code);
    $("failure-codes").textContent = codes.length
      ? "· last hour: " + codes.map(([c, n]) => c + ": " + n).join(", ")
      : "· none in the last hour";
    fill("failures", o.failures.latest.map((f) => row([
      f.finished_at ? new Date(f.finished_at * 1000).toLocaleTimeString() : "–",
      f.code, f.tier, f.tenant_id, f.job_id + (f.batch_id ? " (" + f.batch_id + ")" : ""), f.message,
    ])), "no failed job admitted in the last day");
  }

  function renderWebhooks(o) {
    const counts = o.webhooks.by_status;
    $("webhook-counts").textContent = "· last day: " + Object.entries(counts).map(([s, n]) => s + ": " + n).join(", ");
    fill("webhooks", o.webhooks.undelivered.map((d) => {
      const answer = d.last_error || (d.last_status_code === null ? "–" : String(d.last_status_code));
      const status = d.status === "pending" && d.next_attempt_at
        ? "retrying at " + new Date(d.next_attempt_at * 1000).toLocaleTimeString()
        : d.status;
      const tr = row([
        new Date(d.created_at * 1000).toLocaleTimeString(), d.event_type, d.data.id, d.tenant_id,
        status, d.attempts, answer,
        d.status === "failed"
          ? actionButton("redeliver-" + d.id, "Send again", () => api("POST", "/admin/webhook_deliveries/" + encodeURIComponent(d.id) + "/redeliver"))
          : "",
      ]);
      tr.dataset.delivery = d.id;
      if (d.status === "failed") tr.className = "warn";
      return tr;
    }), "every webhook delivery was taken");
  }

  function render(o) {
    renderTiers(o);
    renderWorkers(o);
    renderBatches(o);
    renderTenants(o);
    renderFailures(o);
    renderWebhooks(o);
    $("status").textContent = "updated " + new Date(o.at * 1000).toLocaleTimeString();
  }

  // The quota form: prefilled from the tenant's all-tiers quota, saved with PUT.
  let quotaTenant = null;
  function openQuota(t) {
    quotaTenant = t.id;
    const form = $("quota-form");
    $("quota-tenant").textContent = t.name;
    const all = t.quota.find((q) => q.tier === null) || {};
    for (const input of form.querySelectorAll("input, select")) {
      const v = all[input.name];
      input.value = v === null || v === undefined ? (input.name === "budget_period" ? "month" : "") : String(v);
    }
    form.hidden = false;
  }

  $("quota-cancel").addEventListener("click", () => { $("quota-form").hidden = true; });
  $("quota-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const form = ev.target;
    const payload = {};
    for (const input of form.querySelectorAll("input, select")) {
      const v = input.value.trim();
      if (input.name === "budget_period") payload[input.name] = v;
      else if (input.name === "spend_budget") payload[input.name] = v === "" ? null : v;
      else payload[input.name] = v === "" ? null : Number(v);
    }
    try {
      await api("PUT", "/admin/tenants/" + encodeURIComponent(quotaTenant) + "/quota", payload);
      form.hidden = true;
      showError("");
    } catch (e) { showError("Saving the quota failed: " + e.message); }
    await poll();
  });

  async function poll() {
    if (busy || !key()) return;
    busy = true;
    try {
      last = await api("GET", "/admin/overview");
      render(last);
      $("board").hidden = false;
      showError("");
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        signOut();
        showError("Refused: " + e.message);
      } else {
        showError("Could not refresh: " + e.message);
      }
    } finally {
      busy = false;
    }
  }

  function signedIn() {
    $("login").hidden = true;
    $("sign-out").hidden = false;
    $("status").textContent = "loading…";
    poll();
    if (timer === null) timer = setInterval(poll, POLL_MS);
  }

  function signOut() {
    sessionStorage.removeItem(KEY_STORE);
    if (timer !== null) { clearInterval(timer); timer = null; }
    $("board").hidden = true;
    for (const id of ["tiers", "workers", "batches", "tenants", "failures", "webhooks"]) $(id).querySelector("tbody").replaceChildren();
    history.length = 0;
    $("login").hidden = false;
    $("sign-out").hidden = true;
    $("status").textContent = "not signed in";
  }

  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("admin-key").value.trim();
    $("admin-key").value = "";
    if (!value) return;
    sessionStorage.setItem(KEY_STORE, value);
    showError("");
    signedIn();
  });
  $("sign-out").addEventListener("click", () => { signOut(); showError(""); });

  if (key()) signedIn();
})();
