// lonnymq web view: refreshes the live part of a page and draws the rates chart.
// Plain JavaScript, no library. The live part is HTML rendered (and escaped) by the server:
// every few seconds it is fetched again from the element's data-refresh URL and swapped in.
"use strict";

(function () {
  var SVG = "http://www.w3.org/2000/svg";
  var SERIES = ["enqueued", "delivered", "acked", "dead"];
  var WINDOW_S = 600;

  function el(name, attrs, text) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    if (text !== undefined) { node.textContent = text; }
    return node;
  }

  function niceMax(value) {
    if (value <= 0) { return 1; }
    var power = Math.pow(10, Math.floor(Math.log10(value)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) {
      if (value <= steps[i] * power) { return steps[i] * power; }
    }
    return 10 * power;
  }

  function label(value) {
    if (value >= 1000) { return (value / 1000).toFixed(value >= 10000 ? 0 : 1) + "k"; }
    return value >= 10 || value === 0 ? value.toFixed(0) : value.toFixed(1);
  }

  // One chart: the series of data-history ([{t, enqueued, delivered, acked, dead}]) over
  // the last ten minutes, as polylines in an inline SVG sized to its box.
  function drawChart(box) {
    var points;
    try { points = JSON.parse(box.getAttribute("data-history") || "[]"); } catch (e) { return; }
    if (!Array.isArray(points) || points.length < 2) { return; }
    var width = Math.max(box.clientWidth, 200), height = 150, left = 44, bottom = 18, top = 8;
    // the last ten minutes, or less while the readings cover less (at least a minute)
    var end = points[points.length - 1].t;
    var span = Math.min(WINDOW_S, Math.max(60, end - points[0].t));
    var start = end - span;
    points = points.filter(function (p) { return p.t >= start; });
    var top_value = 0;
    points.forEach(function (p) {
      SERIES.forEach(function (s) { top_value = Math.max(top_value, Number(p[s]) || 0); });
    });
    var ymax = niceMax(top_value);
    var x = function (t) { return left + (width - left - 4) * (t - start) / span; };
    var y = function (v) { return top + (height - top - bottom) * (1 - v / ymax); };
    var svg = el("svg", { viewBox: "0 0 " + width + " " + height, role: "img",
      "aria-label": "messages per second over the last minutes" });
    [0, 0.5, 1].forEach(function (f) {
      var v = ymax * f;
      svg.appendChild(el("line", { x1: left, x2: width - 4, y1: y(v), y2: y(v), "class": "grid-line" }));
      svg.appendChild(el("text", { x: left - 6, y: y(v) + 3, "text-anchor": "end", "class": "axis" }, label(v)));
    });
    var ago = function (s) { return "-" + (s < 120 ? Math.round(s) + "s" : Math.round(s / 60) + "m"); };
    [[start, ago(span)], [start + span / 2, ago(span / 2)], [end, "now"]].forEach(function (tick, i) {
      var anchor = i === 0 ? "start" : (i === 2 ? "end" : "middle");
      svg.appendChild(el("text", { x: x(tick[0]), y: height - 4, "text-anchor": anchor, "class": "axis" }, tick[1]));
    });
    SERIES.forEach(function (s) {
      var coords = points.map(function (p) {
        return x(p.t).toFixed(1) + "," + y(Number(p[s]) || 0).toFixed(1);
      });
      svg.appendChild(el("polyline", { points: coords.join(" "), "class": s }));
    });
    box.textContent = "";
    box.appendChild(svg);
  }

  function drawCharts(root) {
    Array.prototype.forEach.call(root.querySelectorAll(".chart[data-history]"), drawChart);
  }

  function startRefresh(live) {
    var url = live.getAttribute("data-refresh");
    var every = Math.max(1000, Number(live.getAttribute("data-every")) || 2000);
    var status = document.getElementById("live-status");
    var busy = false, failures = 0;

    function mark(ok, why) {
      if (!status) { return; }
      status.classList.remove("tick");
      if (ok) {
        status.classList.remove("stale");
        status.textContent = "live";
        status.title = "refreshed at " + new Date().toLocaleTimeString();
        void status.offsetWidth;  // restart the pulse
        status.classList.add("tick");
      } else {
        status.classList.add("stale");
        status.textContent = "not refreshing";
        status.title = why;
      }
    }

    function refresh() {
      if (busy || document.hidden) { return; }
      busy = true;
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" }, cache: "no-store" })
        .then(function (response) {
          if (!response.ok) { throw new Error("HTTP " + response.status); }
          return response.text();
        })
        .then(function (html) {
          live.innerHTML = html;  // server-rendered, every value escaped by the server
          drawCharts(live);
          failures = 0;
          mark(true);
        })
        .catch(function (error) {
          failures += 1;
          mark(false, String(error));
        })
        .then(function () { busy = false; });
    }

    window.setInterval(refresh, every);
    document.addEventListener("visibilitychange", function () { if (!document.hidden) { refresh(); } });
  }

  document.addEventListener("DOMContentLoaded", function () {
    drawCharts(document);
    var live = document.getElementById("live");
    if (live && live.getAttribute("data-refresh")) { startRefresh(live); }
    window.addEventListener("resize", function () { drawCharts(document); });
  });
})();
