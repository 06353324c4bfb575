// outbox-cdc console: the only script. Every page reads without it; it adds
//  - the overview's refresh: the live part fetched again every few seconds (no full
//    reload); a lost session (401) goes back to the login form;
//  - "select all" for the parking lot's rows.
// Actions stay form posts carrying the session's CSRF token; a script that posts by
// fetch sends it as the X-CSRF-Token header (consoleCsrf() below).
"use strict";

function consoleCsrf() {
  const meta = document.querySelector('meta[name="csrf-token"]');
  return meta ? meta.content : "";
}

function refreshLive(live) {
  const url = live.dataset.refresh;
  const periodMs = 1000 * Number(live.dataset.refreshS || 5);
  let busy = false;
  async function tick() {
    if (busy || document.hidden) return;
    busy = true;
    try {
      const answer = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      if (answer.status === 401) {
        window.location.assign("/console/login");
        return;
      }
      if (answer.ok) live.innerHTML = await answer.text();
    } catch (e) {
      // the sink restarting: the next tick tries again
    } finally {
      busy = false;
    }
  }
  window.setInterval(tick, periodMs);
}

function selectAll(form) {
  const boxes = form.querySelectorAll('input[type="checkbox"][name="id"]');
  if (!boxes.length) return;
  const toggle = document.createElement("button");
  toggle.type = "button";
  toggle.textContent = "Select all";
  toggle.addEventListener("click", () => {
    const on = !Array.from(boxes).every((b) => b.checked);
    boxes.forEach((b) => { b.checked = on; });
    toggle.textContent = on ? "Select none" : "Select all";
  });
  const actions = form.querySelector(".actions");
  if (actions) actions.prepend(toggle);
}

document.addEventListener("DOMContentLoaded", () => {
  const live = document.getElementById("live");
  if (live) refreshLive(live);
  const rows = document.getElementById("rows");
  if (rows) selectAll(rows);
});
