// The dashboard's own few behaviours. No inline scripts anywhere (the pages are served
// with a Content-Security-Policy that forbids them), so they live here.
(function () {
  "use strict";

  // Forms with data-confirm ask before they submit.
  document.addEventListener("submit", function (event) {
    var form = event.target;
    var button = event.submitter;
    var question = (button && button.getAttribute("data-confirm")) ||
      (form.getAttribute && form.getAttribute("data-confirm"));
    if (question && !window.confirm(question)) {
      event.preventDefault();
    }
  }, true);

  // "Select all" checkboxes, and the selection count on the bulk bar.
  function refreshSelection(table) {
    var boxes = table.querySelectorAll("input[name=job]");
    var checked = table.querySelectorAll("input[name=job]:checked").length;
    var counter = document.getElementById("selected-count");
    if (counter) {
      counter.textContent = checked === 1 ? "1 job selected" : checked + " jobs selected";
    }
    document.querySelectorAll("[data-needs-selection]").forEach(function (button) {
      button.disabled = checked === 0;
    });
    var all = table.querySelector("input[data-select-all]");
    if (all) {
      all.checked = boxes.length > 0 && checked === boxes.length;
    }
  }
  document.addEventListener("change", function (event) {
    var box = event.target;
    var table = box.closest && box.closest("table");
    if (!table) {
      return;
    }
    if (box.hasAttribute("data-select-all")) {
      table.querySelectorAll("input[name=job]").forEach(function (b) {
        b.checked = box.checked;
      });
    }
    refreshSelection(table);
  });
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("table.selectable").forEach(refreshSelection);
  });

  // Live refresh: say when it fails (the database is down), and when it works again.
  document.addEventListener("htmx:responseError", function (event) {
    var banner = document.getElementById("refresh-status");
    if (banner) {
      banner.textContent = "Refresh failed (HTTP " + event.detail.xhr.status + "); retrying.";
      banner.hidden = false;
    }
  });
  document.addEventListener("htmx:sendError", function () {
    var banner = document.getElementById("refresh-status");
    if (banner) {
      banner.textContent = "The dashboard cannot be reached; retrying.";
      banner.hidden = false;
    }
  });
  document.addEventListener("htmx:afterSwap", function () {
    var banner = document.getElementById("refresh-status");
    if (banner) {
      banner.hidden = true;
    }
  });
})();
