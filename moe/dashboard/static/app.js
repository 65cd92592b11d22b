// Expert-load dashboard: polls data.json?since=K, accumulates the windows, draws with plotly.
// Query parameters: poll_ms (poll interval in milliseconds, default 1000).
// window.dashboardState holds what the page shows (tests read it): counts is the cumulative
// layer x expert matrix, lastCounts the last window's, perRank the cumulative layer x rank rows.
(function () {
  "use strict";

  const prefix = document.body.dataset.prefix;
  const params = new URLSearchParams(window.location.search);
  const pollMs = Math.max(50, Number(params.get("poll_ms")) || 1000);
  const TOP_N = 10;
  const plotConfig = { displaylogo: false, displayModeBar: false, responsive: true };
  const font = { family: getComputedStyle(document.body).fontFamily, size: 12, color: "#1d2433" };

  const state = (window.dashboardState = {
    meta: null,
    metaKey: "",
    nextIndex: 0, // the since= of the next poll
    windowsReceived: 0,
    counts: [], // [L][E] cumulative
    lastCounts: [], // [L][E] of the newest window
    perRank: [], // [L][P] cumulative
    windowIndex: [], // per window received
    balanceMean: [], // per window: mean over layers
    balanceLayers: [], // [L][windows]
    stepsCovered: 0,
    totalTokens: 0,
    meanBalancedness: null,
    rebalances: 0,
    hot: [], // [{row, layer, expert, count, share}]
    polls: 0,
    renders: 0,
    lastError: null,
  });
  let heatmapMode = "cumulative";

  const zeros = (rows, cols) => Array.from({ length: rows }, () => new Array(cols).fill(0));
  const fmtInt = (n) => n.toLocaleString("en-US");
  // The server sends a recording's NaN / Infinity as null (JSON has neither): such a value is left out of
  // means, and plotly draws null as a gap in a line.
  const finite = (v) => typeof v === "number" && Number.isFinite(v);
  function meanOfFinite(xs) {
    const ok = xs.filter(finite);
    return ok.length ? ok.reduce((a, b) => a + b, 0) / ok.length : null;
  }

  function reset(meta) {
    const L = meta.layers.length;
    Object.assign(state, {
      meta: meta,
      metaKey: JSON.stringify(meta),
      nextIndex: 0,
      windowsReceived: 0,
      counts: zeros(L, meta.num_experts),
      lastCounts: zeros(L, meta.num_experts),
      perRank: zeros(L, meta.ep_size),
      windowIndex: [],
      balanceMean: [],
      balanceLayers: Array.from({ length: L }, () => []),
      stepsCovered: 0,
      totalTokens: 0,
      meanBalancedness: null,
      hot: [],
    });
    document.title = "Expert load · " + meta.model;
    document.getElementById("title").textContent = "Expert load · " + meta.model;
    document.getElementById("subtitle").textContent =
      `${L} MoE layers · ${meta.num_experts} experts` +
      (meta.num_physical_experts !== meta.num_experts ? ` (${meta.num_physical_experts} physical)` : "") +
      ` · EP ${meta.ep_size} · ${meta.window_steps} steps per window`;
  }

  function addWindow(w) {
    const L = state.meta.layers.length;
    for (let l = 0; l < L; l++) {
      const row = w.counts[l];
      for (let e = 0; e < row.length; e++) {
        state.counts[l][e] += row[e];
        state.totalTokens += row[e];
      }
      state.lastCounts[l] = row.slice();
      for (let r = 0; r < w.per_rank[l].length; r++) state.perRank[l][r] += w.per_rank[l][r];
      state.balanceLayers[l].push(finite(w.balancedness[l]) ? w.balancedness[l] : null);
    }
    state.windowIndex.push(w.index);
    state.balanceMean.push(meanOfFinite(w.balancedness.slice(0, L)));
    state.stepsCovered += w.step_end - w.step_start;
    state.windowsReceived += 1;
    state.nextIndex = w.index + 1;
  }

  // The TOP_N largest cumulative counts; ties go to the lower layer row, then the lower expert.
  function hottest() {
    const cells = [];
    state.counts.forEach((row, l) => {
      const layerTotal = row.reduce((a, b) => a + b, 0);
      row.forEach((c, e) => {
        if (c > 0) cells.push({ row: l, layer: state.meta.layers[l], expert: e, count: c, share: c / layerTotal });
      });
    });
    cells.sort((a, b) => b.count - a.count || a.row - b.row || a.expert - b.expert);
    return cells.slice(0, TOP_N);
  }

  function setNumber(id, value, text) {
    const el = document.getElementById(id);
    el.dataset.value = value === null ? "" : String(value);
    el.textContent = text;
  }

  function renderSummary() {
    state.meanBalancedness = meanOfFinite(state.balanceMean);
    setNumber("total-tokens", state.totalTokens, fmtInt(state.totalTokens));
    setNumber("windows-received", state.windowsReceived, fmtInt(state.windowsReceived));
    setNumber("steps-covered", state.stepsCovered, fmtInt(state.stepsCovered));
    setNumber("mean-balancedness", state.meanBalancedness,
      state.meanBalancedness === null ? "–" : state.meanBalancedness.toFixed(3));
    setNumber("rebalances", state.rebalances, fmtInt(state.rebalances));
  }

  function renderTable() {
    state.hot = hottest();
    const body = document.querySelector("#hot-experts tbody");
    body.replaceChildren(...state.hot.map((h, i) => {
      const tr = document.createElement("tr");
      tr.dataset.row = h.row;
      tr.dataset.layer = h.layer;
      tr.dataset.expert = h.expert;
      tr.dataset.count = h.count;
      tr.dataset.share = h.share;
      const cells = [String(i + 1), String(h.layer), String(h.expert), fmtInt(h.count),
        (100 * h.share).toFixed(1) + " %"];
      cells.forEach((text, c) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (c >= 3) td.className = "num";
        if (c === 4) { // a small gauge of the share before the number
          const track = document.createElement("span");
          const fill = document.createElement("span");
          track.className = "gauge";
          fill.style.width = (100 * h.share).toFixed(1) + "%";
          track.appendChild(fill);
          td.prepend(track);
        }
        tr.appendChild(td);
      });
      return tr;
    }));
  }

  const layerLabels = () => state.meta.layers.map((l) => "layer " + l);
  const margin = { l: 70, r: 16, t: 8, b: 40 };

  function renderHeatmap() {
    // Copies: Plotly.react redraws only arrays it has not seen (state's arrays change in place).
    const z = (heatmapMode === "last" ? state.lastCounts : state.counts).map((row) => row.slice());
    Plotly.react("heatmap", [{
      type: "heatmap",
      z: z,
      x: Array.from({ length: state.meta.num_experts }, (_, e) => e),
      y: layerLabels(),
      colorscale: "YlOrRd",
      reversescale: true, // plotly's YlOrRd runs dark to pale: hot experts dark red
      hovertemplate: "%{y}, expert %{x}: %{z:,} tokens<extra></extra>",
      colorbar: { thickness: 12, outlinewidth: 0 },
    }], {
      margin: margin, font: font, paper_bgcolor: "rgba(0,0,0,0)",
      xaxis: { title: { text: "expert" }, dtick: state.meta.num_experts <= 32 ? 1 : undefined },
      yaxis: { autorange: "reversed", type: "category" },
    }, plotConfig);
  }

  function renderRankBars() {
    const traces = [];
    for (let r = 0; r < state.meta.ep_size; r++) {
      traces.push({ type: "bar", name: "rank " + r, x: layerLabels(), y: state.perRank.map((row) => row[r]),
        hovertemplate: "%{x}, rank " + r + ": %{y:,} rows<extra></extra>" });
    }
    Plotly.react("rank-bars", traces, {
      barmode: "group", margin: margin, font: font, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      legend: { orientation: "h", y: 1.12, x: 0 }, yaxis: { title: { text: "rows" }, gridcolor: "#e2e6ee" },
    }, plotConfig);
  }

  function renderBalance() {
    const traces = [{ type: "scatter", mode: "lines+markers", name: "mean", x: state.windowIndex.slice(),
      y: state.balanceMean.slice(), line: { width: 3, color: "#2f6fde" } }];
    state.balanceLayers.forEach((ys, l) => traces.push({ type: "scatter", mode: "lines", name: layerLabels()[l],
      x: state.windowIndex.slice(), y: ys.slice(), visible: "legendonly", line: { width: 1 } }));
    Plotly.react("balance", traces, {
      margin: margin, font: font, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      showlegend: true, legend: { font: { size: 11 } },
      xaxis: { title: { text: "window" }, tickformat: "d", gridcolor: "#e2e6ee" },
      yaxis: { range: [0, 1.05], title: { text: "mean / max" }, gridcolor: "#e2e6ee" },
    }, plotConfig);
  }

  function render() {
    renderSummary();
    renderTable();
    renderHeatmap();
    renderRankBars();
    renderBalance();
    state.renders += 1;
  }

  function setStatus(kind, text) {
    const el = document.getElementById("status");
    el.dataset.state = kind;
    el.textContent = text;
  }

  // Returns true when the page changed. A new meta, or a server whose newest window is older than
  // what the page has, means the recording was replaced: start over from since=0.
  function apply(payload, since) {
    if (!payload.meta) return false;
    const key = JSON.stringify(payload.meta);
    if (key !== state.metaKey || payload.last_index < state.nextIndex - 1) {
      reset(payload.meta);
      if (since > 0) return true; // this answer skipped windows below since: the next poll asks from 0
    }
    let changed = state.renders === 0 || payload.rebalances !== state.rebalances;
    state.rebalances = payload.rebalances;
    for (const w of payload.windows) {
      if (w.index >= state.nextIndex) {
        addWindow(w);
        changed = true;
      }
    }
    return changed;
  }

  async function poll() {
    try {
      const since = state.nextIndex;
      const resp = await fetch(`${prefix}/data.json?since=${since}`, { cache: "no-store" });
      if (!resp.ok) throw new Error(`data.json: HTTP ${resp.status}`);
      const payload = await resp.json();
      state.polls += 1;
      if (apply(payload, since) && state.meta) render();
      state.lastError = payload.error || null;
      if (payload.error) setStatus("error", payload.error);
      else if (!state.meta) setStatus("connecting", "waiting for the recording's first line…");
      else setStatus("live", `live · updated ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      state.lastError = String(err);
      setStatus("error", "cannot reach the server: " + err.message);
    } finally {
      window.setTimeout(poll, pollMs);
    }
  }

  document.querySelectorAll(".toggle button").forEach((btn) => btn.addEventListener("click", () => {
    heatmapMode = btn.dataset.mode;
    document.querySelectorAll(".toggle button").forEach((b) => b.classList.toggle("active", b === btn));
    if (state.meta) renderHeatmap();
  }));

  poll();
})();
