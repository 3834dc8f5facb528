"use strict";
// light, dark or the system's, chosen before the page draws (no flash)
(() => {
  const saved = localStorage.getItem("tierlm-theme");
  if (saved === "light" || saved === "dark") document.documentElement.dataset.theme = saved;
})();
