// pagedllm live view: keeps the state /dashboard/events sends (a snapshot, then deltas: see
// pagedllm/live_view/frames.py) and draws it on every frame.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const state = { snap: null, owners: new Map(), selected: null, frames: 0, mapCells: [] };
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();

  // A stable colour per request id.
  function requestColor(id, alpha = 1) {
    let h = 0;
    for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
    return `hsla(${(h * 137.508) % 360}, 65%, 58%, ${alpha})`;
  }
  const fmt = (x, d = 0) => (x === null || x === undefined ? "–" : x.toFixed(d));
  const ms = (s) => (s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`);

  function sizeCanvas(canvas) {
    const ratio = window.devicePixelRatio || 1, w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return [ctx, w, h];
  }

  // -- headline ------------------------------------------------------------------------
  function drawHeadline(h) {
    $("h-running").textContent = h.running;
    $("h-waiting").textContent = h.waiting;
    $("h-kv").textContent = `${fmt(100 * h.kv_usage, 1)}%`;
    $("h-hit").textContent = h.prefix_hit_rate === null ? "–" : `${fmt(100 * h.prefix_hit_rate, 1)}%`;
    $("h-in").textContent = fmt(h.tokens_in_per_s);
    $("h-out").textContent = fmt(h.tokens_out_per_s);
    $("h-preempt").textContent = h.preemptions;
    document.body.dataset.preemptions = h.preemptions;
    $("h-steps").textContent = h.steps;
  }

  // -- KV block map: one band per KV cache group, every pool block a cell in each band ---
  function drawMap(snap) {
    const { blocks, config } = snap, n = config.num_blocks, groups = config.group_windows;
    $("map").style.height = `${Math.max(260, 110 * groups.length)}px`;  // a band per group
    const [ctx, w, h] = sizeCanvas($("map"));
    const labelH = 14, bandGap = 6, perBand = (h - groups.length * (labelH + bandGap)) / groups.length;
    let cell = Math.floor(Math.sqrt((w * perBand) / n));
    while (cell > 3 && Math.floor(w / cell) * Math.floor(perBand / cell) < n) cell--;
    cell = Math.max(3, Math.min(cell, 28));
    const cols = Math.max(1, Math.floor(w / cell)), gap = cell > 6 ? 1 : 0;
    const sel = state.selected, cells = [];
    let held = 0;
    groups.forEach((window, g) => {
      const top = g * (perBand + labelH + bandGap);
      ctx.fillStyle = color("--dim"); ctx.font = "11px system-ui";
      ctx.fillText(`group ${g} · ${window ? `sliding window ${window}` : "global"}`, 0, top + 10);
      for (let b = 0; b < n; b++) {
        const x = (b % cols) * cell, y = top + labelH + Math.floor(b / cols) * cell, s = cell - gap;
        const mine = blocks.group[b] === g, ref = blocks.ref[b], owner = blocks.owner[b];
        const rid = owner >= 0 ? blocks.owners[owner] : null;
        const dim = sel !== null && !(rid === sel || (blocks.shared[b] || []).some((p) => p[0] === sel));
        if (mine && ref > 0) {
          held++;
          ctx.fillStyle = requestColor(rid, dim ? 0.18 : 1);
          ctx.fillRect(x, y, s, s);
          if (ref > 1) { ctx.strokeStyle = dim ? "#888" : "#fff"; ctx.lineWidth = Math.max(1, cell / 8); ctx.strokeRect(x + 1, y + 1, s - 2, s - 2); }
        } else if (mine && blocks.cached[b]) {
          ctx.fillStyle = "#2f343d"; ctx.fillRect(x, y, s, s);
          ctx.strokeStyle = dim ? "#3d424b" : "#59606c"; ctx.lineWidth = 1;
          ctx.beginPath(); ctx.moveTo(x, y + s); ctx.lineTo(x + s, y); ctx.stroke();
        } else {
          ctx.fillStyle = "#262a32"; ctx.fillRect(x, y, s, s);
        }
        cells.push({ x, y, s, b, g });
      }
    });
    state.mapCells = cells;
    document.body.dataset.heldBlocks = held;
    $("map-info").textContent = `${n} blocks × ${config.block_size} tokens · ${held} held`;
  }

  function describeBlock(b, g) {
    const { blocks, config } = state.snap, bs = config.block_size;
    const range = (i) => `tokens ${i * bs}–${(i + 1) * bs - 1}`;
    const head = `block ${b} · group ${g}`;
    if (blocks.group[b] !== g && blocks.ref[b] > 0) return `${head}\nin use by group ${blocks.group[b]}`;
    if (blocks.group[b] !== g || (blocks.ref[b] === 0 && !blocks.cached[b])) return `${head}\nfree`;
    if (blocks.ref[b] === 0) {
      const who = blocks.owner[b] >= 0 ? `\nlast held by ${blocks.owners[blocks.owner[b]]}, ${range(blocks.index[b])}` : "";
      return `${head}\ncached, free (a later request with this prefix reuses it)${who}`;
    }
    const holders = blocks.shared[b] || [[blocks.owners[blocks.owner[b]], blocks.index[b]]];
    return `${head} · ref ${blocks.ref[b]}${blocks.cached[b] ? " · cached" : ""}\n` +
      holders.map(([rid, i]) => `${rid}: ${range(i)}`).join("\n");
  }

  $("map").addEventListener("mousemove", (ev) => {
    const r = ev.target.getBoundingClientRect(), mx = ev.clientX - r.left, my = ev.clientY - r.top;
    const hit = state.mapCells.find((c) => mx >= c.x && mx < c.x + c.s && my >= c.y && my < c.y + c.s);
    const tip = $("tooltip");
    if (!hit || !state.snap) { tip.style.display = "none"; return; }
    tip.textContent = describeBlock(hit.b, hit.g);
    tip.style.display = "block"; tip.style.left = `${ev.clientX + 12}px`; tip.style.top = `${ev.clientY + 12}px`;
  });
  $("map").addEventListener("mouseleave", () => { $("tooltip").style.display = "none"; });

  // -- scheduler timeline: one bar per step, stacked by token kind --------------------------
  function drawTimeline(snap) {
    const steps = snap.steps, budget = snap.config.max_num_batched_tokens;
    const [ctx, w, h] = sizeCanvas($("timeline"));
    const top = 12, bottom = h - 16, plotH = bottom - top;
    const maxTokens = Math.max(budget, ...steps.map((s) => s[3] + s[4] + s[5])) * 1.08;
    const barW = Math.max(2, Math.min(12, w / Math.max(steps.length, 1)));
    const shown = steps.slice(-Math.floor(w / barW));
    const y = (tokens) => bottom - (tokens / maxTokens) * plotH;
    const kinds = [[3, "--prefill"], [4, "--decode"], [5, "--draft"]];
    shown.forEach((s, i) => {
      const x = w - (shown.length - i) * barW;
      let base = 0;
      for (const [k, name] of kinds) {
        if (!s[k]) continue;
        ctx.fillStyle = color(name);
        ctx.fillRect(x, y(base + s[k]), Math.max(1, barW - 1), y(base) - y(base + s[k]));
        base += s[k];
      }
      if (s[6]) { ctx.fillStyle = color("--preempt"); ctx.fillRect(x, top - 10, Math.max(2, barW - 1), 8); }
    });
    ctx.strokeStyle = color("--fg"); ctx.setLineDash([5, 4]); ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(0, y(budget)); ctx.lineTo(w, y(budget)); ctx.stroke(); ctx.setLineDash([]);
    ctx.fillStyle = color("--fg"); ctx.font = "11px system-ui";
    ctx.fillText(`${budget} tokens`, 4, y(budget) - 3);
    const times = shown.map((s) => s[2] - s[1]), maxT = Math.max(...times, 1e-3);
    ctx.strokeStyle = color("--steptime"); ctx.lineWidth = 1.5; ctx.beginPath();
    times.forEach((t, i) => {
      const x = w - (shown.length - i) * barW + barW / 2, yy = bottom - (t / maxT) * plotH * 0.95;
      i ? ctx.lineTo(x, yy) : ctx.moveTo(x, yy);
    });
    ctx.stroke();
    ctx.fillStyle = color("--steptime");
    ctx.fillText(`step time, max ${ms(maxT)}`, w - 150, bottom + 12);
    ctx.fillStyle = color("--dim");
    if (shown.length) ctx.fillText(`steps ${shown[0][0]}–${shown[shown.length - 1][0]}`, 4, bottom + 12);
    document.body.dataset.steps = steps.length;
    const mean = times.length ? times.reduce((a, b) => a + b, 0) / times.length : 0;
    $("timeline-info").textContent = shown.length ? `${shown.length} steps · mean ${ms(mean)}` : "no steps yet";
  }

  // -- request waterfall ------------------------------------------------------------------
  function drawWaterfall(snap) {
    const reqs = snap.requests, now = snap.now;
    const t0 = Math.max(now - 60, Math.min(now - 1, ...reqs.map((r) => r.arrival))), span = now - t0;
    const pct = (t) => `${(100 * Math.max(0, t - t0)) / span}%`;
    const wid = (a, b) => `${(100 * Math.max(0, b - Math.max(a, t0))) / span}%`;
    const rows = [`<div class="axis"><div></div><div><span>−${span.toFixed(1)} s</span><span>now</span></div><div></div></div>`];
    for (const r of reqs) {
      const parts = [];
      const waitEnd = r.scheduled ?? r.finished ?? now;
      parts.push(`<span class="w" style="left:${pct(r.arrival)};width:${wid(r.arrival, waitEnd)}"></span>`);
      for (const [a, b, kind] of r.segments) {
        if (b < t0) continue;
        parts.push(`<span class="${kind[0]}" style="left:${pct(a)};width:${wid(a, b)}"></span>`);
      }
      for (const t of r.preemptions) {  // waiting again until the recompute's first chunk
        const next = r.segments.find((seg) => seg[0] > t), back = next ? next[0] : r.finished ?? now;
        if (back < t0) continue;
        parts.push(`<span class="w" style="left:${pct(t)};width:${wid(t, back)}"></span>`);
        parts.push(`<span class="x" style="left:${pct(t)}"></span>`);
      }
      if (r.finished !== null) parts.push(`<span class="f" style="left:${pct(r.finished)}"></span>`);
      const ttft = r.ttft === null ? "" : `TTFT <b>${ms(r.ttft)}</b> · `;
      const last = r.segments[r.segments.length - 1];
      const requeued = r.preemptions.length && (!last || r.preemptions[r.preemptions.length - 1] > last[0]);
      const end = r.reason ? `<b>${r.reason}</b>` : r.scheduled === null ? "waiting" : requeued ? "preempted" : "running";
      const cached = r.cached ? ` · ${r.cached} cached` : "";
      rows.push(`<div class="row${r.id === state.selected ? " selected" : ""}" data-id="${r.id}" data-finished="${r.reason ?? ""}">` +
        `<div class="id"><i style="background:${requestColor(r.id)}"></i>${r.id}</div><div class="bar">${parts.join("")}</div>` +
        `<div class="info">${ttft}${r.output} tok${cached} · ${end}</div></div>`);
    }
    $("waterfall").innerHTML = rows.join("");
    document.body.dataset.requests = reqs.length;
  }

  $("waterfall").addEventListener("click", (ev) => {
    const row = ev.target.closest(".row");
    if (!row) return;
    state.selected = state.selected === row.dataset.id ? null : row.dataset.id;
    if (state.snap) draw(state.snap);
  });

  function draw(snap) {
    state.snap = snap;
    drawHeadline(snap.headline);
    drawMap(snap);
    drawTimeline(snap);
    drawWaterfall(snap);
    document.body.dataset.frames = ++state.frames;
  }

  // -- frames: a snapshot starts the state, each delta updates it -------------------------
  function load(snap) {
    state.owners = new Map(snap.blocks.owners.map((id, i) => [id, i]));  // request id -> index in owners
    return snap;
  }

  function applyDelta(snap, d) {
    snap.version = d.version; snap.now = d.now; snap.headline = d.headline;
    if (d.steps.length) snap.steps = snap.steps.concat(d.steps).slice(-snap.num_steps);
    const rows = new Map(snap.requests.map((r) => [r.id, r]));
    for (const r of d.requests) rows.set(r.id, r);
    snap.requests = (d.order ?? snap.requests.map((r) => r.id)).map((id) => rows.get(id));
    const bl = snap.blocks;
    for (const [b, ref, cached, group, holder, index, shared] of d.blocks) {
      bl.ref[b] = ref; bl.cached[b] = cached; bl.group[b] = group; bl.index[b] = index;
      let owner = -1;
      if (holder !== null) {
        owner = state.owners.get(holder);
        if (owner === undefined) { owner = bl.owners.length; bl.owners.push(holder); state.owners.set(holder, owner); }
      }
      bl.owner[b] = owner;
      if (shared) bl.shared[b] = shared; else delete bl.shared[b];
    }
    return snap;
  }

  // The API key, if the page was opened with ?api_key=..., goes along to the event stream.
  const source = new EventSource(`/dashboard/events${window.location.search}`);
  source.onmessage = (ev) => {
    $("status").textContent = "live"; $("status").className = "status live";
    const frame = JSON.parse(ev.data);
    if (frame.kind === "full") draw(load(frame));
    else if (state.snap) draw(applyDelta(state.snap, frame));  // a stream (re)starts with a snapshot
  };
  source.onerror = () => { $("status").textContent = "reconnecting…"; $("status").className = "status lost"; };
  window.addEventListener("resize", () => state.snap && draw(state.snap));
})();
