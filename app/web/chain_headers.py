"""`X-Gpulane-Chain: ID` and `X-Gpulane-Chain-Length: N`: the caller names the run
a request belongs to (a film's shots, submitted one at a time) and, if it knows,
how many requests the run has. Ids are the caller's own: two callers' `film-1`
are two chains (docs/jobs.md, "Chains")."""

from __future__ import annotations

import re

from app.web.request_body import BadRequest

CHAIN_HEADER = "x-gpulane-chain"
CHAIN_LENGTH_HEADER = "x-gpulane-chain-length"
MAX_CHAIN_ID = 128
MAX_CHAIN_LENGTH = 1_000_000
_ID = re.compile(r"[A-Za-z0-9._:-]+")
_DIGITS = re.compile(r"[0-9]+")
_ALLOWED_ID = f"1 to {MAX_CHAIN_ID} characters of letters, digits and . _ : -, such as film-1"


def read_chain(headers: dict[str, str]) -> tuple[str | None, int | None]:
    """The chain id and length a request names; (None, None) without the headers.
    A bad value is a 400 naming the header and what it allows."""
    chain = headers.get(CHAIN_HEADER)
    length = headers.get(CHAIN_LENGTH_HEADER)
    if chain is None:
        if length is not None:
            raise BadRequest(
                400,
                "X-Gpulane-Chain-Length needs X-Gpulane-Chain: the length is that of a chain "
                "the request names",
                "invalid_chain",
            )
        return None, None
    chain = chain.strip()
    if not (len(chain) <= MAX_CHAIN_ID and _ID.fullmatch(chain)):
        shown = chain if len(chain) <= 40 else chain[:40] + "..."
        raise BadRequest(
            400,
            f"X-Gpulane-Chain: {shown!r} ({len(chain)} characters) is not allowed; "
            f"expected {_ALLOWED_ID}",
            "invalid_chain",
        )
    if length is None:
        return chain, None
    plain = length.strip()
    if not (len(plain) <= 7 and _DIGITS.fullmatch(plain) and 0 < int(plain) <= MAX_CHAIN_LENGTH):
        raise BadRequest(
            400,
            f"X-Gpulane-Chain-Length: {plain[:40]!r} is not allowed; expected the chain's "
            f"number of requests, a whole number from 1 to {MAX_CHAIN_LENGTH} in plain digits",
            "invalid_chain_length",
        )
    return chain, int(plain)
