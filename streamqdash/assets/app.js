// streamq dashboard: refreshes the page every poll interval from one JSON
// read (the overview: GET api/stats; a queue page: GET api/queue, the counts
// and the visible list together), keeps the selection of the list, and draws
// the chart of jobs processed and failed per minute over the last 24 hours
// (GET api/history, from the counts Redis keeps). No dependencies, no build
// step, nothing inline (the page's CSP allows scripts from 'self' only).
(function () {
  "use strict";

  var SVG = "http://www.w3.org/2000/svg";

  // Destructive buttons ask first.
  document.addEventListener("click", function (e) {
    var b = e.target.closest ? e.target.closest("button[data-confirm]") : null;
    if (b && !window.confirm(b.getAttribute("data-confirm"))) {
      e.preventDefault();
    }
  });

  // ---- Selection of the list's rows -------------------------------------
  function boxes() {
    return document.querySelectorAll('#list tbody input[type="checkbox"][name="id"], #list tbody input[type="checkbox"][name="job"]');
  }

  function selectionChanged() {
    var n = 0;
    var all = boxes();
    for (var i = 0; i < all.length; i++) {
      if (all[i].checked) {
        n++;
      }
    }
    var count = document.getElementById("sel-count");
    if (count) {
      count.textContent = String(n);
    }
    var buttons = document.querySelectorAll("#sel button.needs-sel");
    for (var j = 0; j < buttons.length; j++) {
      buttons[j].disabled = n === 0;
    }
    var head = document.getElementById("sel-all");
    if (head) {
      head.checked = n > 0 && n === all.length;
      head.indeterminate = n > 0 && n < all.length;
    }
  }

  document.addEventListener("change", function (e) {
    if (e.target.id === "sel-all") {
      var all = boxes();
      for (var i = 0; i < all.length; i++) {
        all[i].checked = e.target.checked;
      }
    }
    selectionChanged();
  });
  selectionChanged();

  var poll = parseInt(document.body.getAttribute("data-poll"), 10) || 0;
  var nameEl = document.getElementById("queue-name");
  var queue = nameEl ? nameEl.textContent : "";
  var note = document.getElementById("chart-note");

  // ---- Counts -----------------------------------------------------------
  function scopes(name) {
    var out = [];
    var all = document.querySelectorAll("[data-q]");
    for (var i = 0; i < all.length; i++) {
      if (all[i].getAttribute("data-q") === name) {
        out.push(all[i]);
      }
    }
    return out;
  }

  function set(scope, field, text) {
    var els = scope.querySelectorAll('[data-f="' + field + '"]');
    for (var i = 0; i < els.length; i++) {
      if (els[i].textContent !== text) {
        els[i].textContent = text;
      }
    }
  }

  function rate(cur, old, seconds) {
    var d = cur - old; // a consumer restart starts its totals again: count 0
    return d > 0 && seconds > 0 ? d / seconds : 0;
  }

  function fmt(r) {
    return r >= 100 ? r.toFixed(0) : r.toFixed(1);
  }

  var prev = null; // the previous sample: {time, totals: {queue: [succeeded, failed]}}

  function counts(time, q) {
    var ok = null;
    var failed = null;
    var seconds = prev ? (time - prev.time) / 1000 : 0;
    if (prev && prev.totals[q.name]) {
      ok = rate(q.succeeded, prev.totals[q.name][0], seconds);
      failed = rate(q.failed, prev.totals[q.name][1], seconds);
    }
    scopes(q.name).forEach(function (s) {
      set(s, "length", String(q.length));
      set(s, "scheduled", String(q.scheduled));
      set(s, "pending", String(q.pending));
      set(s, "lag", q.lag < 0 ? "unknown" : String(q.lag));
      set(s, "dead_letters", String(q.dead_letters));
      set(s, "canceled", String(q.canceled));
      set(s, "consumers", String(q.consumers));
      set(s, "stale_consumers", String(q.stale_consumers));
      (q.levels || []).forEach(function (l) {
        set(s, "level_" + l.priority, String(l.length));
        set(s, "level_pending_" + l.priority, String(l.pending));
      });
      var tabs = q.tabs || {};
      Object.keys(tabs).forEach(function (k) {
        set(s, "tab_" + k, tabs[k] < 0 ? "?" : String(tabs[k]));
      });
      set(s, "latency", latency(q.latency_ms));
      set(s, "fanout_dead_letters", String(q.fanout_dead_letters || 0));
      var state = s.querySelector('[data-f="state"]');
      if (state) {
        var badge = q.paused ? "paused" : q.consumers === 0 && (q.length > 0 || q.pending > 0) ? "no consumers" : "";
        if (state.textContent !== badge) {
          state.textContent = "";
          if (badge) {
            var b = document.createElement("span");
            b.className = q.paused ? "badge" : "badge bad";
            b.textContent = badge;
            state.appendChild(b);
          }
        }
      }
      if (ok !== null) {
        set(s, "rate_ok", fmt(ok));
        set(s, "rate_failed", fmt(failed));
      }
    });
  }

  // ---- The list of a queue page -----------------------------------------
  var jobs = document.getElementById("jobs");
  var touched = 0; // when the user last pressed something in the list
  if (jobs) {
    ["pointerdown", "keydown"].forEach(function (ev) {
      jobs.addEventListener(ev, function () {
        touched = Date.now();
      });
    });
  }

  var skew = 0; // the server's clock minus the browser's, ms
  var shown = null; // the list's HTML without its relative times

  // coarse and relText say what relTime in the Go code says.
  function coarse(ms) {
    var s = Math.round(ms / 1000);
    function two(a, au, b, bu) {
      return b === 0 ? a + au : a + au + " " + b + bu;
    }
    if (s < 60) {
      return s + "s";
    }
    if (s < 3600) {
      return two(Math.floor(s / 60), "m", s % 60, "s");
    }
    if (s < 86400) {
      return two(Math.floor(s / 3600), "h", Math.floor((s % 3600) / 60), "m");
    }
    return two(Math.floor(s / 86400), "d", Math.floor((s % 86400) / 3600), "h");
  }

  // latency says what the Go code's latency says: the age of the oldest
  // job waiting to be read.
  function latency(ms) {
    if (!(ms > 0)) {
      return "–";
    }
    return ms < 1000 ? "<1s" : coarse(ms);
  }

  function relText(t) {
    var d = t - (Date.now() + skew);
    return d >= 0 ? "in " + coarse(d) : coarse(-d) + " ago";
  }

  // ageTimes rewrites the relative times ("in 3m", "2m ago") for now.
  function ageTimes() {
    var all = jobs.querySelectorAll(".rel[data-t]");
    for (var i = 0; i < all.length; i++) {
      var t = +all[i].getAttribute("data-t");
      if (t > 0) {
        var text = relText(t);
        if (all[i].textContent !== text) {
          all[i].textContent = text;
        }
      }
    }
  }

  // replaceList swaps the list for the one just read, keeping what was
  // selected (by value) where it is still listed. A list that changed only
  // in its relative times is kept (its times are aged in place), so a
  // refresh does not replace the rows under the user's pointer for nothing.
  function replaceList(html, digest) {
    if (shown === null) {
      shown = jobs.getAttribute("data-digest");
    }
    if (digest === shown || Date.now() - touched < 1500) {
      ageTimes();
      return; // the same list, or under the user's pointer: the next poll replaces it
    }
    shown = digest;
    var keep = {};
    var all = boxes();
    for (var i = 0; i < all.length; i++) {
      if (all[i].checked) {
        keep[all[i].value] = true;
      }
    }
    // The server rendered it with html/template, escaped as the page is.
    jobs.innerHTML = html;
    all = boxes();
    for (var j = 0; j < all.length; j++) {
      if (keep[all[j].value]) {
        all[j].checked = true;
      }
    }
    selectionChanged();
  }

  function getJSON(url) {
    return fetch(url, { headers: { Accept: "application/json" }, cache: "no-store", credentials: "same-origin" })
      .then(function (r) {
        return r.json().then(function (body) {
          if (!r.ok) {
            throw new Error(body.error || r.statusText);
          }
          return body;
        });
      });
  }

  function refresh() {
    if (jobs) {
      return getJSON("api/queue?" + jobs.getAttribute("data-query")).then(function (body) {
        skew = body.time - Date.now();
        counts(body.time, body.queue);
        var totals = {};
        totals[body.queue.name] = [body.queue.succeeded, body.queue.failed];
        prev = { time: body.time, totals: totals };
        replaceList(body.html, body.digest);
        jobs.setAttribute("data-time", String(body.time));
      });
    }
    return getJSON("api/stats").then(function (body) {
      var totals = {};
      (body.queues || []).forEach(function (q) {
        if (!q.error) {
          counts(body.time, q);
          totals[q.name] = [q.succeeded, q.failed];
        }
      });
      prev = { time: body.time, totals: totals };
    });
  }

  // ---- The chart ----------------------------------------------------------
  var chart = document.getElementById("chart");
  var history = null; // the last api/history body
  var span = 1440; // minutes shown: the last 24 h, 6 h or 1 h of the history
  var SPANS = { 1440: ["24 hours", "24 h", 3 * 60], 360: ["6 hours", "6 h", 60], 60: ["hour", "1 h", 10] };

  document.addEventListener("click", function (e) {
    var b = e.target.closest ? e.target.closest("#spans button") : null;
    if (!b) {
      return;
    }
    setSpan(parseInt(b.getAttribute("data-span"), 10));
    try {
      window.localStorage.setItem("streamqdash.span", String(span));
    } catch (err) {
      // storage off: the choice lasts for this page
    }
    draw();
  });

  function setSpan(minutes) {
    if (!SPANS[minutes]) {
      return;
    }
    span = minutes;
    var all = document.querySelectorAll("#spans button");
    for (var i = 0; i < all.length; i++) {
      all[i].className = all[i].getAttribute("data-span") === String(span) ? "on" : "";
    }
  }
  try {
    setSpan(parseInt(window.localStorage.getItem("streamqdash.span"), 10));
  } catch (err) {
    // storage off: 24 hours
  }

  function el(name, attrs, text) {
    var e = document.createElementNS(SVG, name);
    for (var k in attrs) {
      if (Object.prototype.hasOwnProperty.call(attrs, k)) {
        e.setAttribute(k, String(attrs[k]));
      }
    }
    if (text !== undefined) {
      e.textContent = text;
    }
    return e;
  }

  // niceCeil rounds v up to 1, 2 or 5 times a power of ten.
  function niceCeil(v) {
    if (v <= 4) {
      return 4;
    }
    var p = Math.pow(10, Math.floor(Math.log(v) / Math.LN10));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] * p >= v) {
        return steps[i] * p;
      }
    }
    return 10 * p;
  }

  function short(n) {
    if (n >= 1e6) {
      return (n / 1e6).toFixed(n % 1e6 ? 1 : 0) + "M";
    }
    if (n >= 1e4) {
      return (n / 1e3).toFixed(n % 1e3 ? 1 : 0) + "k";
    }
    return String(n);
  }

  function pad(n) {
    return n < 10 ? "0" + n : String(n);
  }

  function draw() {
    if (!chart || !history) {
      return;
    }
    var pts = (history.points || []).slice(-span);
    var W = Math.max(320, Math.round(chart.getBoundingClientRect().width) || 1000);
    var H = Math.max(120, Math.round(chart.getBoundingClientRect().height) || 160);
    var L = 64;
    var R = 14;
    var T = 12;
    var B = 40;
    chart.setAttribute("viewBox", "0 0 " + W + " " + H);
    while (chart.firstChild) {
      chart.removeChild(chart.firstChild);
    }
    var top = 0;
    var sumP = 0;
    var sumF = 0;
    pts.forEach(function (p) {
      top = Math.max(top, p.processed, p.failed);
      sumP += p.processed;
      sumF += p.failed;
    });
    top = niceCeil(top);
    var now = history.time;
    var end = pts.length ? Date.parse(pts[pts.length - 1].minute) + 60000 : now;
    var start = end - span * 60000;
    function x(ms) {
      return L + ((ms - start) / (end - start)) * (W - L - R);
    }
    function y(v) {
      return T + (1 - v / top) * (H - T - B);
    }
    // Horizontal grid with the counts per minute.
    for (var i = 0; i <= 4; i++) {
      var v = (top / 4) * i;
      chart.appendChild(el("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: i ? "grid" : "axis" }));
      chart.appendChild(el("text", { x: L - 6, y: y(v) + 4, class: "ylabel", "text-anchor": "end" }, short(v)));
    }
    chart.appendChild(el("text", { x: 14, y: T + (H - T - B) / 2, class: "unit", "text-anchor": "middle",
      transform: "rotate(-90 14 " + (T + (H - T - B) / 2) + ")" }, "jobs / minute"));
    // Time axis: a tick every 3 hours (1 hour, 10 minutes) on the UTC clock.
    var step = SPANS[span][2] * 60000;
    for (var t = Math.ceil(start / step) * step; t <= end; t += step) {
      var d = new Date(t);
      chart.appendChild(el("line", { x1: x(t), x2: x(t), y1: T, y2: H - B + 4, class: "grid" }));
      chart.appendChild(el("text", { x: x(t), y: H - B + 17, class: "xlabel", "text-anchor": "middle" },
        pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes())));
    }
    chart.appendChild(el("text", { x: W - R, y: H - 4, class: "unit", "text-anchor": "end" }, "time (UTC), one point per minute"));
    chart.appendChild(el("text", { x: L, y: H - 4, class: "unit" }, SPANS[span][1] + " ago"));
    function line(key, cls) {
      var s = pts.map(function (p) {
        return x(Date.parse(p.minute)).toFixed(1) + "," + y(p[key]).toFixed(1);
      }).join(" ");
      var pl = el("polyline", { points: s, class: cls, id: "chart-" + key });
      chart.appendChild(pl);
    }
    // Failed first: processed counts the failures too, so it is never
    // below, and where both are 0 the processed line shows.
    line("failed", "bad");
    line("processed", "ok");
    chart.setAttribute("data-points", String(pts.length));
    chart.setAttribute("data-max", String(top));
    document.getElementById("hist-processed").textContent = String(sumP);
    document.getElementById("hist-failed").textContent = String(sumF);
    document.getElementById("chart-span").textContent = SPANS[span][0];
    document.getElementById("hist-over").textContent = "in " + SPANS[span][1];
  }

  function loadHistory() {
    return getJSON("api/history" + (queue ? "?q=" + encodeURIComponent(queue) : "")).then(function (body) {
      history = body;
      draw();
    });
  }

  if (chart) {
    window.addEventListener("resize", draw);
  }

  // ---- Polling --------------------------------------------------------------
  var turn = 0;
  function tick() {
    var work = [refresh()];
    // The history changes per minute: read it on the first turn and every
    // fifth one after.
    if (chart && turn % 5 === 0) {
      work.push(loadHistory());
    }
    turn++;
    Promise.all(work)
      .then(function () {
        if (note) {
          var d = new Date();
          note.textContent = "· updated " + pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes()) + ":" + pad(d.getUTCSeconds()) + " UTC";
        }
      })
      .catch(function (err) {
        if (note) {
          note.textContent = "· refresh failed: " + err.message;
        }
      })
      .then(function () {
        if (poll) {
          window.setTimeout(tick, poll);
        }
      });
  }
  if (poll || chart) {
    tick();
  }
})();
