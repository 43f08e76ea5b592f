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

  // -- KV block map: one band per KV cache group ------------------------------------------
  // A pool that fits at MIN_CELL pixels a block is drawn whole, in block order. A larger one
  // (the default cache: thousands of blocks) draws only the blocks in use, in block order:
  // held and cached ones, or the held ones alone when those are too many, and under them a
  // strip of the whole pool (per pixel column, the share of its blocks held or cached).
  const MIN_CELL = 8, MAX_CELL = 28, TINY_CELL = 2, STRIP_H = 10;

  // The largest cell (px) at which `count` cells fit in w x h, or 0 if none >= `least` does.
  function cellSize(count, w, h, least) {
    for (let c = MAX_CELL; c >= least; c--) if (Math.floor(w / c) * Math.floor(h / c) >= count) return c;
    return 0;
  }

  function drawMap(snap) {
    const { blocks, config } = snap, n = config.num_blocks, groups = config.group_windows;
    $("map").style.height = `${Math.max(260, 130 * groups.length)}px`;  // a band per group
    const [ctx, w, h] = sizeCanvas($("map"));
    const labelH = 14, bandGap = 6, perBand = (h - groups.length * (labelH + bandGap)) / groups.length;
    const sel = state.selected, cells = [];
    let held = 0, cached = 0, heldCell = 0, heldAt = "";
    groups.forEach((window, g) => {
      const top = g * (perBand + labelH + bandGap);
      const inUse = [], heldIds = [];
      for (let b = 0; b < n; b++) {
        if (blocks.group[b] !== g) continue;
        if (blocks.ref[b] > 0) { inUse.push(b); heldIds.push(b); held++; }
        else if (blocks.cached[b]) { inUse.push(b); cached++; }
      }
      let shown = null, cell = cellSize(n, w, perBand, MIN_CELL), what = `${n} blocks`;
      if (!cell) {  // zoomed: the blocks in use above, the whole pool's strip below
        const area = perBand - STRIP_H - 4;
        cell = cellSize(inUse.length, w, area, MIN_CELL);
        shown = inUse;
        what = `${inUse.length} in use of ${n} blocks`;
        if (!cell) {
          shown = heldIds;
          cell = cellSize(heldIds.length, w, area, TINY_CELL) || TINY_CELL;
          what = `${heldIds.length} held of ${n} blocks (cached ones in the strip)`;
        }
        drawStrip(ctx, blocks, n, g, w, top + labelH + perBand - STRIP_H);
      }
      ctx.fillStyle = color("--dim"); ctx.font = "11px system-ui";
      ctx.fillText(`group ${g} · ${window ? `sliding window ${window}` : "global"} · ${what}`, 0, top + 10);
      const cols = Math.max(1, Math.floor(w / cell)), gap = cell > 6 ? 1 : 0, count = shown ? shown.length : n;
      for (let i = 0; i < count; i++) {
        const b = shown ? shown[i] : i;
        const x = (i % cols) * cell, y = top + labelH + Math.floor(i / cols) * cell, s = cell - gap;
        const mine = blocks.group[b] === g, ref = blocks.ref[b], owner = blocks.owner[b];
        const rid = owner >= 0 ? blocks.owners[owner] : null;
        const dim = sel !== null && !(rid === sel || (blocks.shared[b] || []).some((p) => p[0] === sel));
        if (mine && ref > 0) {
          if (!heldAt && ref === 1) { heldCell = s; heldAt = `${x},${y}`; }  // for the page's test
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
    Object.assign(document.body.dataset, { heldBlocks: held, heldCell, heldCellAt: heldAt });
    const dtype = config.cache_dtype ? ` · K/V ${config.cache_dtype}` : "";
    $("map-info").textContent = `${n} blocks × ${config.block_size} tokens${dtype} · ${held} held · ${cached} cached`;
  }

  // The whole pool in one row: per pixel column, its blocks' share held (bright) and cached (grey).
  function drawStrip(ctx, blocks, n, g, w, y) {
    ctx.fillStyle = "#262a32"; ctx.fillRect(0, y, w, STRIP_H);
    for (let x = 0; x < w; x++) {
      const from = Math.floor((x * n) / w), to = Math.max(from + 1, Math.floor(((x + 1) * n) / w));
      let h = 0, c = 0;
      for (let b = from; b < to; b++) {
        if (blocks.group[b] !== g) continue;
        if (blocks.ref[b] > 0) h++; else if (blocks.cached[b]) c++;
      }
      if (h) { ctx.fillStyle = `rgba(216, 221, 230, ${0.35 + (0.65 * h) / (to - from)})`; ctx.fillRect(x, y, 1, STRIP_H); }
      else if (c) { ctx.fillStyle = "#59606c"; ctx.fillRect(x, y + STRIP_H / 2, 1, STRIP_H / 2); }
    }
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

  // -- scheduler timeline: one column per step, in three lanes with scales of their own ---
  // Prefill tokens against the step budget, decode (and draft) tokens against their own
  // largest count, and the step time in milliseconds against its 95th percentile (a slower
  // step, such as the first one's warm-up, is cut at the top of its lane).
  const nice = (x) => {  // the smallest 1, 2 or 5 x 10^k >= x
    const p = 10 ** Math.floor(Math.log10(Math.max(x, 1e-9)));
    return [1, 2, 5, 10].map((m) => m * p).find((v) => v >= x * (1 - 1e-9));
  };

  const quantile = (xs, q) => {
    if (!xs.length) return 0;
    const sorted = [...xs].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
  };

  function drawTimeline(snap) {
    const steps = snap.steps, budget = snap.config.max_num_batched_tokens;
    const [ctx, w, h] = sizeCanvas($("timeline"));
    const left = 52, top = 12, bottom = h - 16, laneGap = 8, plotW = w - left;
    const laneH = (bottom - top - 2 * laneGap) / 3;
    const barW = Math.max(2, Math.min(12, plotW / Math.max(steps.length, 1)));
    const shown = steps.slice(-Math.floor(plotW / barW));
    const xOf = (i) => w - (shown.length - i) * barW;
    const times = shown.map((s) => (s[2] - s[1]) * 1000);
    const lanes = [
      { label: "prefill tokens", max: Math.max(budget, ...shown.map((s) => s[3])), unit: "" },
      { label: "decode + draft tokens", max: nice(Math.max(1, ...shown.map((s) => s[4] + s[5]))), unit: "" },
      { label: "step time", max: nice(Math.max(1, 1.25 * quantile(times, 0.95))), unit: " ms" },
    ];
    ctx.font = "11px system-ui";
    lanes.forEach((lane, k) => {
      lane.top = top + k * (laneH + laneGap); lane.bottom = lane.top + laneH;
      lane.y = (v) => lane.bottom - (Math.min(v, lane.max) / lane.max) * laneH;
      ctx.fillStyle = "#1f232a"; ctx.fillRect(left, lane.top, plotW, laneH);
      ctx.fillStyle = color("--dim"); ctx.textAlign = "right";
      ctx.fillText(`${lane.max}${lane.unit}`, left - 4, lane.top + 9);
      ctx.fillText(`0${lane.unit}`, left - 4, lane.bottom);
      ctx.textAlign = "left";
    });
    const [pre, dec, time] = lanes;
    shown.forEach((s, i) => {
      const x = xOf(i), bw = Math.max(1, barW - 1);
      if (s[3]) { ctx.fillStyle = color("--prefill"); ctx.fillRect(x, pre.y(s[3]), bw, pre.bottom - pre.y(s[3])); }
      if (s[4]) { ctx.fillStyle = color("--decode"); ctx.fillRect(x, dec.y(s[4]), bw, dec.bottom - dec.y(s[4])); }
      if (s[5]) { ctx.fillStyle = color("--draft"); ctx.fillRect(x, dec.y(s[4] + s[5]), bw, dec.y(s[4]) - dec.y(s[4] + s[5])); }
      if (s[6]) { ctx.fillStyle = color("--preempt"); ctx.fillRect(x, top - 10, Math.max(2, bw), 8); }
    });
    ctx.strokeStyle = color("--fg"); ctx.setLineDash([5, 4]); ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(left, pre.y(budget)); ctx.lineTo(w, pre.y(budget)); ctx.stroke(); ctx.setLineDash([]);
    ctx.fillStyle = color("--fg"); ctx.textAlign = "right";
    ctx.fillText(`budget ${budget}`, w - 4, pre.y(budget) + 11);
    ctx.textAlign = "left";
    ctx.strokeStyle = color("--steptime"); ctx.lineWidth = 1.5; ctx.beginPath();
    times.forEach((t, i) => {
      const x = xOf(i) + barW / 2, y = time.y(t);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = color("--dim");
    for (const lane of lanes) ctx.fillText(lane.label, left + 4, lane.top + 10);  // over the bars
    if (shown.length) ctx.fillText(`steps ${shown[0][0]}–${shown[shown.length - 1][0]}`, left, bottom + 12);
    document.body.dataset.steps = steps.length;
    const mean = times.length ? times.reduce((a, b) => a + b, 0) / times.length / 1000 : 0;
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
