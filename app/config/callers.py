"""Who a caller is, and which request headers carry a credential.

A caller is named by its API key's `label`, or, without `apiKeys`, by the
`X-Gpulane-Caller` header; both follow `CALLER_LABEL`, so a label is safe in a
log line, a metric label and a SQL row. A credential header is never written to
the event log and is forwarded upstream only as `passCredentials` says.
"""

from __future__ import annotations

import re
from typing import Final

CALLER_LABEL: Final = re.compile(r"[A-Za-z0-9._~@:+#/-]{1,64}")
CALLER_LABEL_RULE: Final = "1-64 characters of letters, digits and . _ - ~ @ : + # /"

ROLES: Final = ("admin", "user")

CREDENTIAL_HEADERS: Final = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "x-api-key",
        "api-key",  # Azure OpenAI
        "x-goog-api-key",  # Gemini
        "x-auth-token",
        "x-access-token",
        "x-amz-security-token",
    }
)
"""Lower-case names; `apiKeys` are presented in the first and fourth."""

PASSABLE_CREDENTIALS: Final = CREDENTIAL_HEADERS - {"proxy-authorization"}
"""What `passCredentials` may forward: Proxy-Authorization is for gpulane itself
(hop-by-hop), so it never goes further."""


def is_caller_label(text: str) -> bool:
    return CALLER_LABEL.fullmatch(text) is not None
