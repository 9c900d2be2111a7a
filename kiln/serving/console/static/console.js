// The kiln console's start: the API-key gate, the tabs, and connecting (the card first: a 401
// there means the server wants a key, and nothing else is sent until it is given). Loaded last.
"use strict";

// -- the API key gate ----------------------------------------------------------------------------

function lock(message) {
  auth.unlocked = false;
  document.body.classList.add("locked");
  $("key-gate").hidden = false;
  $("send").disabled = true;
  $("key-error").textContent = message || "";
  $("api-key").focus();
}

function unlock() {
  auth.unlocked = true;
  document.body.classList.remove("locked");
  $("key-gate").hidden = true;
  $("send").disabled = chat.busy;
}

async function connect() {
  let response;
  try {
    response = await api("/console/api/card");
  } catch (e) {
    if (e instanceof Unauthorized) {
      if (!auth.key) $("key-error").textContent = "";
      return;
    }
    setTimeout(connect, 2000);          // the server is not reachable yet
    return;
  }
  if (auth.key) sessionStorage.setItem(KEY_STORAGE, auth.key);
  unlock();
  renderCard(await response.json());
  followStats();
}

$("key-form").addEventListener("submit", event => {
  event.preventDefault();
  auth.key = $("api-key").value.trim();
  $("key-error").textContent = "";
  connect();
});

// -- tabs -------------------------------------------------------------------------------------------

function showTab(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.hidden = tab.id !== name;
  for (const b of document.querySelectorAll(".tab-button")) b.classList.toggle("active", b.dataset.tab === name);
  if (name === "dashboard") renderDashboard();
}

for (const b of document.querySelectorAll(".tab-button")) {
  b.addEventListener("click", () => { history.replaceState(null, "", `#${b.dataset.tab}`); showTab(b.dataset.tab); });
}

// -- start ------------------------------------------------------------------------------------------------

const TABS = ["playground", "dashboard", "artifact"];
const tabInUrl = () => TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "playground";
window.addEventListener("hashchange", () => showTab(tabInUrl()));
showTab(tabInUrl());
connect();
