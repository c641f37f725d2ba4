// streamq dashboard: refreshes the counts of the page and draws the chart of
// requests processed and failed per second, from the totals GET api/stats
// returns (consumers report them in their heartbeats). No dependencies.
(function () {
  "use strict";

  // Destructive buttons ask first.
  document.addEventListener("click", function (e) {
    var b = e.target.closest ? e.target.closest("button[data-confirm]") : null;
    if (b && !window.confirm(b.getAttribute("data-confirm"))) {
      e.preventDefault();
    }
  });

  var poll = parseInt(document.body.getAttribute("data-poll"), 10) || 0;
  var chart = document.getElementById("chart");
  if (!poll || !chart) {
    return;
  }
  var nameEl = document.getElementById("queue-name");
  var url = "api/stats" + (nameEl ? "?q=" + encodeURIComponent(nameEl.textContent) : "");
  var note = document.getElementById("chart-note");
  var MAX_POINTS = 60;
  var prev = null; // the previous sample: {time, totals: {queue: [succeeded, failed]}}
  var series = []; // [{ok, failed}] per second, oldest first

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

  function update(body) {
    var totals = {};
    var sumOk = 0;
    var sumFailed = 0;
    var seconds = prev ? (body.time - prev.time) / 1000 : 0;
    (body.queues || []).forEach(function (q) {
      if (q.error) {
        return;
      }
      totals[q.name] = [q.succeeded, q.failed];
      var ok = null;
      var failed = null;
      if (prev && prev.totals[q.name]) {
        ok = rate(q.succeeded, prev.totals[q.name][0], seconds);
        failed = rate(q.failed, prev.totals[q.name][1], seconds);
        sumOk += ok;
        sumFailed += failed;
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
    });
    if (prev) {
      series.push({ ok: sumOk, failed: sumFailed });
      if (series.length > MAX_POINTS) {
        series.shift();
      }
      draw();
    }
    prev = { time: body.time, totals: totals };
    note.textContent = "updated " + new Date(body.time).toLocaleTimeString();
  }

  function draw() {
    var top = 1;
    series.forEach(function (p) {
      top = Math.max(top, p.ok, p.failed);
    });
    var step = 600 / (MAX_POINTS - 1);
    var x0 = 600 - step * (series.length - 1);
    function points(key) {
      return series.map(function (p, i) {
        return (x0 + i * step).toFixed(1) + "," + (158 - (p[key] / top) * 140).toFixed(1);
      }).join(" ");
    }
    document.getElementById("chart-ok").setAttribute("points", points("ok"));
    document.getElementById("chart-failed").setAttribute("points", points("failed"));
    document.getElementById("chart-max").textContent = fmt(top) + "/s";
    var last = series[series.length - 1];
    document.getElementById("rate-ok").textContent = fmt(last.ok);
    document.getElementById("rate-failed").textContent = fmt(last.failed);
    chart.setAttribute("data-points", String(series.length));
  }

  function tick() {
    fetch(url, { headers: { Accept: "application/json" }, cache: "no-store", credentials: "same-origin" })
      .then(function (r) {
        return r.json().then(function (body) {
          if (!r.ok) {
            throw new Error(body.error || r.statusText);
          }
          return body;
        });
      })
      .then(update)
      .catch(function (err) {
        note.textContent = "refresh failed: " + err.message;
      })
      .then(function () {
        window.setTimeout(tick, poll);
      });
  }
  tick();
})();
