# Headless Chromium for the browser tests (tests/browser) and `make screenshots`:
# Debian's chromium package, driven by Playwright for Python (a dev dependency,
# installed with the venv) pointed at it, so no browser is downloaded.
# Idempotent: returns at once when chromium is on PATH.
.PHONY: chromium

chromium: $(STAMP) ## install Debian's chromium for the browser tests (skips when present)
	@if command -v chromium >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "chromium is missing and installing it needs root: run" >&2; \
		echo "  sudo apt-get update && sudo apt-get install -y chromium" >&2; \
		exit 1; \
	fi; \
	echo "installing Debian's chromium (about 30 s)"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
