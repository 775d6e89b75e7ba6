// The report's only script: page buttons, and a node's details on click.
(function () {
  "use strict";
  var data = {};
  // dot may place a page's first node far to the right: scroll it into view
  function showFirst(pic) {
    var node = pic.querySelector(".page.on g.node");
    if (!node) return;
    var box = node.getBoundingClientRect(), frame = pic.getBoundingClientRect();
    pic.scrollLeft += box.left - frame.left - 40;
  }

  document.querySelectorAll(".picture").forEach(function (pic) {
    var byId = {};
    JSON.parse(pic.querySelector("script.node-data").textContent).forEach(function (n) {
      byId[String(n.id)] = n;
    });
    data[pic.dataset.graph] = byId;
    var fit = pic.querySelector(".fit-toggle");
    if (fit) fit.addEventListener("click", function () { pic.classList.toggle("fit"); });
    showFirst(pic);
    pic.querySelectorAll(".pager button").forEach(function (button) {
      button.addEventListener("click", function () {
        pic.querySelectorAll(".pager button, .page").forEach(function (el) {
          el.classList.toggle("on", el.dataset.page === button.dataset.page);
        });
        showFirst(pic);
      });
    });
  });

  function describe(n) {
    var lines = ["%" + n.id + " " + n.op + "  " + n.type,
                 "dtype " + n.dtype + "  shape (" + n.shape.join(", ") + ")  strides (" +
                 n.strides.join(", ") + ")"];
    if (n.args.length) lines.push("args " + n.args.map(function (a) { return "%" + a; }).join(", ") +
                                  (n.consts.length ? "  constants " + n.consts.join(", ") : ""));
    if (n.kernel) lines.push("kernel " + n.kernel);
    if (n.rule) lines.push(n.rule);
    if (n.fallback) lines.push("runs through ATen: " + n.fallback);
    if (n.time) lines.push("time: " + n.time);
    return lines.join("\n");
  }

  // a time table sorts by the column clicked: numbers largest first, text A to Z
  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.querySelectorAll("th").forEach(function (th, col) {
      th.addEventListener("click", function () {
        var body = table.tBodies[0];
        var numeric = th.dataset.sort === "num";
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = a.cells[col], y = b.cells[col];
          if (numeric) return parseFloat(y.dataset.v) - parseFloat(x.dataset.v);
          return x.textContent.localeCompare(y.textContent);
        });
        rows.forEach(function (row) { body.appendChild(row); });
        table.querySelectorAll("th").forEach(function (h) { h.classList.toggle("sorted", h === th); });
      });
    });
  });

  document.addEventListener("click", function (event) {
    var el = event.target.closest ? event.target.closest("g.node, tr.node-row") : null;
    if (!el || !el.id) return;
    var pic = el.closest(".picture");
    var section = el.closest("section.graph");
    if (!pic || !section) return;
    var graph = pic.dataset.graph;
    var node = data[graph] && data[graph][el.id.slice(graph.length + 1)];
    if (!node) return;
    document.querySelectorAll(".selected").forEach(function (s) { s.classList.remove("selected"); });
    el.classList.add("selected");
    var info = section.querySelector(".node-info");
    info.textContent = graph + ": " + describe(node);  // text, never HTML
    info.hidden = false;
  });
})();
