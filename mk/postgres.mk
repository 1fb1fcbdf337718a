# Debian's PostgreSQL server for the tests marked `postgres` (tests/postgres.py
# starts a throwaway cluster from its binaries: its own data directory and
# port, as `nobody` when run as root, stopped at the end). Only the binaries
# are needed: no cluster is created and no service is started here.
# Idempotent: returns at once when initdb is installed. Debian's package creates
# and may start a `main` cluster; it is stopped (the tests start their own).
.PHONY: postgres

postgres: ## install Debian's PostgreSQL server binaries for the tests (skips when present)
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "PostgreSQL is missing and installing it needs root: run" >&2; \
		echo "  sudo apt-get update && sudo apt-get install -y postgresql" >&2; \
		exit 1; \
	fi; \
	echo "installing Debian's PostgreSQL (about 30 s)"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null; \
	if command -v pg_ctlcluster >/dev/null 2>&1; then \
		for v in $$(ls /usr/lib/postgresql); do pg_ctlcluster $$v main stop 2>/dev/null || true; done; \
	fi
