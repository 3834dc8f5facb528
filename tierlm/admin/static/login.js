"use strict";
document.getElementById("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const input = document.getElementById("key");
  const error = document.getElementById("login-error");
  error.textContent = "";
  const r = await fetch("/admin/login", {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ key: input.value }), credentials: "same-origin",
  });
  input.value = "";
  if (r.ok) { location.href = "/admin"; return; }
  let message = "log in failed (" + r.status + ")";
  try { message = (await r.json()).error.message; } catch (e) { /* keep the status */ }
  error.textContent = message;
});
