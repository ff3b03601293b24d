"""HTTP pieces every Relay server shares: the run-token check."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import HTTPException, Request


def bearer_guard(token: str) -> Callable[[Request], None]:
    """A FastAPI dependency refusing (401) any request without `Authorization: Bearer <token>`;
    compared in constant time."""
    expected = f"Bearer {token}".encode()

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise HTTPException(401, "missing or wrong 'Authorization: Bearer <run token>'")

    return check
