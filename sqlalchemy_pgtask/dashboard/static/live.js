/* pgtask dashboard: live refresh of the page's [data-live] region, by polling.
   A static file (the CSP allows scripts from the dashboard itself only, never inline ones).
   It asks for the page's own URL with the X-Pgtask-Fragment header; the server answers with
   the region's content alone. It pauses while the tab is hidden, skips a round while the
   operator is typing in the region, and a header toggle (remembered per browser) turns it
   off. Without this script every page is the same, refreshed by a reload. */
(function () {
  "use strict";
  var region = document.querySelector("[data-live]");
  var seconds = Number(document.body.getAttribute("data-live-interval"));
  if (!region || !(seconds > 0) || !window.fetch) { return; }
  var KEY = "pgtask-live";
  var on = true;
  try { on = window.localStorage.getItem(KEY) !== "off"; } catch (e) { on = true; }
  var timer = null;
  var inflight = false;

  var toggle = document.createElement("button");
  toggle.type = "button";
  toggle.className = "live-toggle";
  toggle.setAttribute("data-testid", "live-toggle");
  var who = document.querySelector("header .who");
  (who || document.body).insertBefore(toggle, who ? who.firstChild : null);

  function show() {
    toggle.textContent = on ? "Live: on" : "Live: off";
    toggle.setAttribute("aria-pressed", on ? "true" : "false");
    toggle.title = on ? "Refreshing every " + seconds + " s; click to stop" : "Click to refresh live";
    region.setAttribute("data-live-state", on ? "on" : "off");
  }

  function schedule() {
    window.clearTimeout(timer);
    timer = null;
    if (on && !document.hidden) { timer = window.setTimeout(refresh, seconds * 1000); }
  }

  function typing() {
    var active = document.activeElement;
    return active && active !== document.body && region.contains(active) &&
      /^(INPUT|TEXTAREA|SELECT)$/.test(active.tagName);
  }

  function refresh() {
    if (inflight || !on || document.hidden) { return; }
    if (typing()) { schedule(); return; }
    inflight = true;
    window.fetch(window.location.href, {
      headers: { "X-Pgtask-Fragment": "live" }, credentials: "same-origin", cache: "no-store"
    }).then(function (answer) {
      if (!answer.ok || answer.headers.get("X-Pgtask-Fragment") !== "live") {
        throw new Error("not a live fragment: " + answer.status);
      }
      return answer.text();
    }).then(function (html) {
      if (!typing()) {
        region.innerHTML = html;
        region.setAttribute("data-live-refreshed", String(Date.now()));
      }
      region.removeAttribute("data-live-error");
    }).catch(function () {
      region.setAttribute("data-live-error", "true");
    }).then(function () {
      inflight = false;
      schedule();
    });
  }

  toggle.addEventListener("click", function () {
    on = !on;
    try { window.localStorage.setItem(KEY, on ? "on" : "off"); } catch (e) { /* private mode */ }
    show();
    if (on) { refresh(); } else { schedule(); }
  });
  document.addEventListener("visibilitychange", function () {
    if (document.hidden) { schedule(); } else { refresh(); }
  });
  show();
  schedule();
}());
