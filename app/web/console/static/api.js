// Every request to gpulane goes through api(): it adds the API key (kept in
// sessionStorage, sent as a header, never in a URL) and asks for one on a 401.
const KEY = "gpulane.apiKey";
let asking = null;

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function askKey(problem) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  const error = document.getElementById("key-error");
  error.hidden = !problem;
  error.textContent = problem || "";
  input.value = "";
  asking = new Promise((resolve) => {
    form.addEventListener(
      "submit",
      (event) => {
        event.preventDefault();
        sessionStorage.setItem(KEY, input.value.trim());
        dialog.close();
        asking = null;
        resolve();
      },
      { once: true },
    );
  });
  if (!dialog.open) dialog.showModal();
  return asking;
}

export async function api(path, options = {}) {
  for (;;) {
    const headers = new Headers(options.headers || {});
    const key = sessionStorage.getItem(KEY);
    if (key) headers.set("Authorization", "Bearer " + key);
    const response = await fetch(path, { ...options, headers, cache: "no-store" });
    if (response.status === 401) {
      sessionStorage.removeItem(KEY);
      await askKey(key ? "That key was rejected: it is not one of this server's apiKeys." : null);
      continue;
    }
    const type = response.headers.get("content-type") || "";
    const body = type.includes("json") ? await response.json() : await response.text();
    if (!response.ok) {
      const error = (body && body.error) || {};
      throw new ApiError(response.status, error.message || String(body), error.code);
    }
    return body;
  }
}
