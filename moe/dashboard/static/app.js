// Expert-load dashboard: polls data.json?since=K, accumulates the windows, draws with plotly.
// Query parameters: poll_ms (poll interval in milliseconds, default 1000).
// window.dashboardState holds what the page shows (tests read it): counts is the cumulative
// layer x expert matrix, lastCounts the last window's, perRank the cumulative layer x rank rows;
// per window: windowTime (local wall-clock time it closed), imbalance* (max / mean over the experts of
// a layer) and balance* (mean / max over the EP ranks).
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
    windowTime: [], // per window: "YYYY-MM-DD HH:MM:SS.mmm" local time, null without a valid time
    windowSteps: [], // per window: "s–e"
    lastTime: null, // unix seconds of the newest window
    imbalanceMean: [], // per window: mean over layers
    imbalanceLayers: [], // [L][windows]
    balanceMean: [], // per window: mean over layers
    balanceLayers: [], // [L][windows]
    stepsCovered: 0,
    totalTokens: 0,
    meanImbalance: null,
    meanBalancedness: null,
    singleRank: false, // one EP rank: balancedness is 1 by definition, so it is not charted
    stopped: null, // the payload's {why, time} once no window will come again
    rebalances: 0,
    hot: [], // [{row, layer, expert, count, share}]
    polls: 0,
    renders: 0,
    lastError: null,
  });
  let heatmapMode = "cumulative";

  const zeros = (rows, cols) => Array.from({ length: rows }, () => new Array(cols).fill(0));
  const fmtInt = (n) => n.toLocaleString("en-US");
  const pad = (n, width = 2) => String(n).padStart(width, "0");
  // The server sends a recording's NaN / Infinity as null (JSON has neither): such a value is left out of
  // means, and plotly draws null as a gap in a line.
  const finite = (v) => typeof v === "number" && Number.isFinite(v);
  function meanOfFinite(xs) {
    const ok = xs.filter(finite);
    return ok.length ? ok.reduce((a, b) => a + b, 0) / ok.length : null;
  }
  // Plotly reads a date string without a zone as it is, so a local-time string puts the axis in the
  // reader's wall-clock time (a number would be UTC).
  function localTime(unixS) {
    if (!finite(unixS)) return null;
    const d = new Date(unixS * 1000);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
  }
  const clock = (unixS) => new Date(unixS * 1000).toLocaleTimeString();

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
      windowTime: [],
      windowSteps: [],
      lastTime: null,
      imbalanceMean: [],
      imbalanceLayers: Array.from({ length: L }, () => []),
      balanceMean: [],
      balanceLayers: Array.from({ length: L }, () => []),
      stepsCovered: 0,
      totalTokens: 0,
      meanImbalance: null,
      meanBalancedness: null,
      singleRank: meta.ep_size === 1,
      hot: [],
    });
    // One rank: no chart of ranks, and the chart over time takes the whole row. Plots start afresh, sized
    // to their panels (a rewritten file may bring another layout).
    Plotly.purge("over-time");
    Plotly.purge("rank-bars");
    document.getElementById("rank-panel").hidden = state.singleRank;
    document.getElementById("time-panel").classList.toggle("wide", state.singleRank);
    document.getElementById("balancedness-card").classList.toggle("trivial", state.singleRank);
    document.getElementById("balancedness-hint").textContent = state.singleRank ? "(one EP rank)" : "(1 = even)";
    document.getElementById("time-note").textContent = state.singleRank
      ? "one EP rank: rank balancedness is 1 by definition, so only the expert imbalance is drawn"
      : "a point per window: mean over layers; legend: single layers";
    document.getElementById("uniform-share").textContent = (100 / meta.num_experts).toPrecision(3) + " %";
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
      state.imbalanceLayers[l].push(finite(w.expert_imbalance[l]) ? w.expert_imbalance[l] : null);
    }
    state.windowIndex.push(w.index);
    state.windowTime.push(localTime(w.time));
    state.windowSteps.push(`${w.step_start}–${w.step_end}`);
    if (finite(w.time)) state.lastTime = w.time;
    state.balanceMean.push(meanOfFinite(w.balancedness.slice(0, L)));
    state.imbalanceMean.push(meanOfFinite(w.expert_imbalance.slice(0, L)));
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
    state.meanImbalance = meanOfFinite(state.imbalanceMean);
    setNumber("total-tokens", state.totalTokens, fmtInt(state.totalTokens));
    setNumber("windows-received", state.windowsReceived, fmtInt(state.windowsReceived));
    setNumber("steps-covered", state.stepsCovered, fmtInt(state.stepsCovered));
    setNumber("mean-imbalance", state.meanImbalance,
      state.meanImbalance === null ? "–" : state.meanImbalance.toFixed(2));
    setNumber("mean-balancedness", state.meanBalancedness, state.singleRank ? "always 1"
      : state.meanBalancedness === null ? "–" : state.meanBalancedness.toFixed(3));
    setNumber("rebalances", state.rebalances, fmtInt(state.rebalances));
  }

  function renderTable() {
    state.hot = hottest();
    const E = state.meta.num_experts;
    // The gauges share one scale, the largest share shown, so the uniform share's tick stays visible
    // even among hundreds of experts.
    const scale = Math.max(1 / E, ...state.hot.map((h) => h.share));
    const pct = (x) => (100 * x / scale).toFixed(1) + "%";
    const digits = E > 100 ? 2 : 1; // among hundreds of experts a share is below 1 %
    const body = document.querySelector("#hot-experts tbody");
    body.replaceChildren(...state.hot.map((h, i) => {
      const tr = document.createElement("tr");
      tr.dataset.row = h.row;
      tr.dataset.layer = h.layer;
      tr.dataset.expert = h.expert;
      tr.dataset.count = h.count;
      tr.dataset.share = h.share;
      tr.dataset.vsUniform = h.share * E;
      const cells = [String(i + 1), String(h.layer), String(h.expert), fmtInt(h.count),
        (100 * h.share).toFixed(digits) + " %", (h.share * E).toFixed(2) + "×"];
      cells.forEach((text, c) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (c >= 3) td.className = "num";
        if (c === 4) { // a small gauge of the share before the number, with a tick at the uniform share
          const track = document.createElement("span");
          const fill = document.createElement("span");
          const tick = document.createElement("span");
          track.className = "gauge";
          fill.className = "fill";
          fill.style.width = pct(h.share);
          tick.className = "uniform";
          tick.style.left = pct(1 / E);
          track.append(fill, tick);
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
      legend: { orientation: "h", x: 0, y: 1, yanchor: "bottom" }, yaxis: { title: { text: "rows" }, gridcolor: "#e2e6ee" },
    }, plotConfig);
  }

  // Both per-window measures over wall-clock time: the expert imbalance on top and, with more than
  // one EP rank, the rank balancedness below it (same time axis, zoomed together). A layer's legend
  // entry shows its line in both.
  const LAYER_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf"];

  function renderOverTime() {
    const x = state.windowTime.slice();
    const info = state.windowIndex.map((index, i) => [index, state.windowSteps[i]]);
    const hover = (what) => `%{x|%H:%M:%S} · window %{customdata[0]} (steps %{customdata[1]})<br>${what}` +
      "<extra>%{fullData.name}</extra>";
    const series = (name, ys, axes, extra) => Object.assign({ type: "scatter", name: name, x: x, y: ys.slice(),
      customdata: info, xaxis: axes[0], yaxis: axes[1] }, extra);
    const both = !state.singleRank;
    const traces = [series("expert imbalance", state.imbalanceMean, ["x", "y"], {
      mode: "lines+markers", line: { width: 3, color: "#e8590c" }, hovertemplate: hover("max / mean %{y:.2f}") })];
    if (both) {
      traces.push(series("rank balancedness", state.balanceMean, ["x2", "y2"], {
        mode: "lines+markers", line: { width: 3, color: "#2f6fde" }, hovertemplate: hover("mean / max %{y:.3f}") }));
    }
    layerLabels().forEach((label, l) => {
      const line = { width: 1, color: LAYER_COLORS[l % LAYER_COLORS.length] };
      traces.push(series(label, state.imbalanceLayers[l], ["x", "y"], { mode: "lines", line: line,
        visible: "legendonly", legendgroup: label, hovertemplate: hover("max / mean %{y:.2f}") }));
      if (both) {
        traces.push(series(label, state.balanceLayers[l], ["x2", "y2"], { mode: "lines", line: line,
          visible: "legendonly", legendgroup: label, showlegend: false, hovertemplate: hover("mean / max %{y:.3f}") }));
      }
    });
    const grid = "#e2e6ee";
    const muted = "#6b7485";
    // Subplot titles above each plot (axis titles would not fit two short plots).
    const title = (text, y) => ({ text: text, xref: "paper", x: 0, xanchor: "left", yref: "paper", y: y,
      yanchor: "bottom", showarrow: false, font: { size: 12, color: font.color } });
    const top = both ? [0.6, 1] : [0, 1];
    const timed = x.some((t) => t !== null); // else plotly would label an empty axis with the year 2000
    const layout = {
      margin: { l: 44, r: 16, t: 22, b: 36 }, font: font, paper_bgcolor: "rgba(0,0,0,0)",
      plot_bgcolor: "rgba(0,0,0,0)", showlegend: true, legend: { font: { size: 11 } },
      xaxis: { type: "date", anchor: "y", gridcolor: grid, showticklabels: !both && timed },
      // Never below 1 (uniform); the dotted line marks it.
      yaxis: { domain: top, gridcolor: grid, autorangeoptions: { include: [1] } },
      shapes: [{ type: "line", xref: "x domain", x0: 0, x1: 1, yref: "y", y0: 1, y1: 1,
        line: { color: muted, width: 1, dash: "dot" } }],
      annotations: [title("expert imbalance: max / mean of the tokens over a layer's experts", top[1]),
        { text: "uniform", xref: "x domain", x: 1, xanchor: "right", yref: "y", y: 1, yanchor: "bottom",
          showarrow: false, font: { size: 10, color: muted } }],
    };
    if (both) {
      layout.xaxis2 = { type: "date", anchor: "y2", matches: "x", gridcolor: grid, showticklabels: timed };
      layout.yaxis2 = { domain: [0, 0.38], range: [0, 1.05], gridcolor: grid };
      layout.annotations.push(title("rank balancedness: mean / max of the rows over the EP ranks", 0.38));
    }
    Plotly.react("over-time", traces, layout, plotConfig);
  }

  function render() {
    renderSummary();
    renderTable();
    renderHeatmap();
    if (!state.singleRank) renderRankBars();
    renderOverTime();
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
      state.stopped = payload.stopped || null;
      const stopped = state.stopped && ("stopped" + (finite(state.stopped.time) ? " at " + clock(state.stopped.time)
        : "") + " · " + state.stopped.why);
      if (payload.error) setStatus("error", (stopped ? stopped + " · " : "") + payload.error);
      else if (!state.meta) setStatus("connecting", "waiting for the recording's first line…");
      else if (stopped) setStatus("stopped", stopped);
      else setStatus("live", state.lastTime === null ? "live · no window yet" : `live · last window ${clock(state.lastTime)}`);
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
