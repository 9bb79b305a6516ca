(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("tpcheck-data").textContent);
  var C = D.cols, ix = {};
  if (D.packed) {  // columns holding one value in every row travel once, in D.const
    var at = {};
    D.packed.forEach(function (c, i) { at[c] = i; });
    D.rows = D.rows.map(function (r) {
      return C.map(function (c) { return c in at ? r[at[c]] : D["const"][c]; });
    });
  }
  C.forEach(function (c, i) { ix[c] = i; });
  var RE = /^layers\.(\d+)\.(.+)$/;
  var VC = C.slice(3);  // value columns, in r.slice(3) order
  var FLOATS = VC.map(function (c) { return D.floats.indexOf(c) >= 0; });
  var rows = D.rows.map(function (r, n) {
    var p = D.points[r[0]], m = RE.exec(p);
    var v = r.slice(3).map(function (x, i) {  // non-finite numbers travel as "inf" / "-inf"
      return FLOATS[i] && typeof x === "string" ? (x === "inf" ? Infinity : (x === "-inf" ? -Infinity : NaN)) : x;
    });
    return {n: n, point: p, layer: m ? +m[1] : null, kind: m ? m[2] : p, step: r[1], mode: D.modes[r[2]], v: v};
  });
  var COLS = ["point", "layer", "step", "mode", "kind"].concat(VC);
  function val(row, c) {
    if (c in row && c !== "v") return row[c];
    var x = row.v[VC.indexOf(c)];
    return x;
  }
  function fmt(c, x) {
    if (x === null || x === undefined) return c === "layer" ? "-" : (c === "note" ? "" : "nan");
    if (c === "passed") return x ? "yes" : "NO";
    if (Array.isArray(x)) return "[" + x.join(", ") + "]";
    if (typeof x === "number") {
      if (!isFinite(x)) return x > 0 ? "inf" : "-inf";
      if (Number.isInteger(x) && ["step", "layer", "nan", "inf"].indexOf(c) >= 0) return String(x);
      var a = Math.abs(x);
      return x === 0 ? "0" : (a < 1e-3 || a >= 1e5 ? x.toExponential(3) : x.toPrecision(4));
    }
    return String(x);
  }
  function cmp(a, b) {
    var an = a === null || a === undefined || (typeof a === "number" && isNaN(a));
    var bn = b === null || b === undefined || (typeof b === "number" && isNaN(b));
    if (an || bn) return an === bn ? 0 : (an ? 1 : -1);
    if (Array.isArray(a)) { a = a.join(","); b = b.join(","); }
    return a < b ? -1 : (a > b ? 1 : 0);
  }

  // chart selector
  var sel = document.getElementById("chart-select");
  if (sel) sel.addEventListener("change", function () {
    document.querySelectorAll("figure.chart").forEach(function (f) { f.hidden = f.id !== sel.value; });
  });

  // table
  var thead = document.querySelector("#rows thead tr"), tbody = document.querySelector("#rows tbody");
  var fText = document.getElementById("f-text"), fMode = document.getElementById("f-mode"),
      fStep = document.getElementById("f-step"), fFail = document.getElementById("f-fail"),
      fSize = document.getElementById("f-size"), info = document.getElementById("f-info"),
      prev = document.getElementById("f-prev"), next = document.getElementById("f-next");
  var sortCol = null, sortDir = 1, page = 0, view = rows;
  var origin = D.origin;
  COLS.forEach(function (c) {
    var th = document.createElement("th");
    th.textContent = c;
    th.title = (D.legend || {})[c] || "";  // what the column says (tpcheck.result.columns): a property, never markup
    th.dataset.col = c;
    th.addEventListener("click", function () {
      if (sortCol === c) sortDir = -sortDir; else { sortCol = c; sortDir = c === "excess" || c === "rel_err" ? -1 : 1; }
      thead.querySelectorAll("th").forEach(function (h) { h.className = h.dataset.col === sortCol ? (sortDir > 0 ? "asc" : "desc") : ""; });
      update(true);
    });
    thead.appendChild(th);
  });
  function update(resetPage) {
    var q = fText.value.trim().toLowerCase(), m = fMode.value, s = fStep.value, onlyFail = fFail.checked;
    view = rows.filter(function (r) {
      if (m && r.mode !== m) return false;
      if (s !== "" && r.step !== +s) return false;
      if (onlyFail && val(r, "passed")) return false;
      if (q && r.point.toLowerCase().indexOf(q) < 0 && String(val(r, "note") || "").toLowerCase().indexOf(q) < 0) return false;
      return true;
    });
    if (sortCol) {
      view = view.slice().sort(function (a, b) { return sortDir * cmp(val(a, sortCol), val(b, sortCol)) || a.n - b.n; });
    }
    if (resetPage) page = 0;
    render();
  }
  function render() {
    var size = fSize.value === "all" ? view.length || 1 : +fSize.value;
    var pages = Math.max(1, Math.ceil(view.length / size));
    page = Math.min(page, pages - 1);
    var lo = page * size, hi = Math.min(view.length, lo + size);
    var frag = document.createDocumentFragment();
    for (var i = lo; i < hi; i++) {
      var r = view[i], tr = document.createElement("tr");
      if (!val(r, "passed")) tr.className = "fail";
      if (origin && r.point === origin.point && r.step === origin.step && r.mode === origin.mode) tr.className += " origin";
      COLS.forEach(function (c) {
        var td = document.createElement("td"), x = val(r, c);
        td.textContent = fmt(c, x);
        if (typeof x === "number" && c !== "layer" && c !== "step") td.className = "num";
        if (c === "rel_err" || c === "excess" || c === "passed") td.className += " v";
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    }
    tbody.replaceChildren(frag);
    var nf = view.filter(function (r) { return !val(r, "passed"); }).length;
    info.textContent = (view.length ? (lo + 1) + "\u2013" + hi : "0") + " of " + view.length + " rows (" + nf +
      " failing; " + rows.length + " in all), page " + (page + 1) + "/" + pages;
    prev.disabled = page === 0; next.disabled = page >= pages - 1;
  }
  [fText, fMode, fStep, fFail, fSize].forEach(function (el) {
    el.addEventListener(el === fText ? "input" : "change", function () { update(true); });
  });
  prev.addEventListener("click", function () { page--; render(); });
  next.addEventListener("click", function () { page++; render(); });
  var copy = document.getElementById("copy-cmd");
  if (copy) copy.addEventListener("click", function () {
    var t = document.getElementById("command").textContent;
    try {
      if (navigator.clipboard) navigator.clipboard.writeText(t).then(function () { copy.textContent = "copied"; },
        function () { copy.textContent = "select and copy"; });
    } catch (err) { copy.textContent = "select and copy"; }
  });
  update(true);
  document.body.setAttribute("data-rendered", "1");
})();
