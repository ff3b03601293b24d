"""The run's credentials: one key per power, each process holding only those it needs.

A run has one secret, its token (`<run dir>/.relay/token`, mode 0600, made by the launcher).
No server accepts the token itself: every route needs the key of its scope, derived from the
token (HMAC-SHA256 of the scope's name), so a key of one scope tells nothing of another's.

| scope | routes | held by |
| --- | --- | --- |
| `rollout` | `/v1/*`, served ahead of API clients' requests | the orchestrator |
| `inference` | `/v1/*` of the inference servers | API clients (`<run dir>/api_key`) |
| `admin` | `/admin/*` but the broadcast: load, sleep, wake, version | the orchestrator |
| `publish` | `/admin/weights/broadcast` | the trainer |
| `queue-push` | the queue's `/push` (and `/stats`) | the orchestrator |
| `queue-pull` | the queue's `/batch` (and `/stats`) | the trainer |

A server holds the keys of the scopes it checks (`serves`), a client those of the routes it
calls (`calls`). The launcher hands each role process its keys in `RELAY_KEYS` and no token
(`role_env`); a role started by hand derives them from the run directory's token. An agent's
episode has a key of its own, valid for its session while it is open
(rl/orchestrator/agent_proxy.py). Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from fastapi import Request
# fastapi is imported where a guard is made: the launcher, which imports this module, never
# needs it.

KEYS_ENV = "RELAY_KEYS"
TOKEN_ENV = "RELAY_TOKEN"
SCOPES = ("rollout", "inference", "admin", "publish", "queue-push", "queue-pull")

# What each role serves (checks) and calls, by the launcher's role names.
SERVES = {
    "queue": ("queue-push", "queue-pull"),
    "inference": ("rollout", "inference", "admin", "publish"),
    "router": ("rollout", "inference", "admin", "publish"),
    "orchestrator": (),
    "trainer": (),
}
CALLS = {
    "queue": (),
    "inference": (),
    "router": ("rollout", "admin", "publish"),  # passes each call on with its own scope
    "orchestrator": ("rollout", "admin", "queue-push"),
    "trainer": ("queue-pull", "publish"),
}
BROADCAST_PREFIX = "/admin/weights/broadcast"


def scope_of(path: str) -> tuple[str, ...]:
    """The scopes whose key opens `path` (none: /health, which is open)."""
    if path == "/health":
        return ()
    if path.startswith(BROADCAST_PREFIX):
        return ("publish",)
    if path.startswith("/admin/"):
        return ("admin",)
    if path.startswith("/push"):
        return ("queue-push",)
    if path.startswith("/batch"):
        return ("queue-pull",)
    if path.startswith("/stats"):
        return ("queue-push", "queue-pull")
    if path == "/openapi.json":  # the API's description: any key of the server
        return SCOPES
    return ("rollout", "inference")  # the run's own rollouts first, then API clients


def derive(token: str, scopes: Iterable[str] = SCOPES) -> dict[str, str]:
    """The keys of `scopes`, from the run's token."""
    return {
        scope: hmac.new(token.encode(), f"relay/{scope}".encode(), hashlib.sha256).hexdigest()
        for scope in scopes
    }


def as_keys(credential: str | Mapping[str, str]) -> dict[str, str]:
    """Keys from a mapping of them, or every scope's from a run token (tests, tools)."""
    return derive(credential) if isinstance(credential, str) else dict(credential)


def token_auth(token: str) -> ScopedAuth:
    """Authentication holding every scope's key of the run whose token this is."""
    return ScopedAuth(derive(token))


def encode_keys(keys: Mapping[str, str]) -> str:
    return ",".join(f"{scope}={key}" for scope, key in sorted(keys.items()))


def decode_keys(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def role_keys(token: str, role: str) -> dict[str, str]:
    """What one role process gets: the keys it checks and the keys it calls with."""
    return derive(token, sorted({*SERVES.get(role, ()), *CALLS.get(role, ())}))


def role_env(env: Mapping[str, str], role: str) -> dict[str, str]:
    """A role process's environment: its own keys in place of the run's token."""
    out = dict(env)
    token = out.pop(TOKEN_ENV, None)
    if token:
        out[KEYS_ENV] = encode_keys(role_keys(token, role))
    return out


def without_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """An environment for a program the run does not trust (an agent): no token, no keys."""
    return {k: v for k, v in env.items() if k not in (KEYS_ENV, TOKEN_ENV)}


def _bearer(keys: Mapping[str, str], scopes: Iterable[str]) -> list[bytes]:
    return [f"Bearer {keys[s]}".encode() for s in scopes if s in keys]


def scoped_guard(credential: str | Mapping[str, str]) -> Callable[[Request], None]:
    """A FastAPI dependency refusing (401) a request without the key of its route's scope
    (`scope_of`); `credential`: the keys of the scopes this server checks, or a run's token
    (every scope's)."""
    keys = as_keys(credential)

    from fastapi import HTTPException, Request

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        # Every expected key is compared, so the time taken says nothing about which matched.
        scopes = [s for s in scope_of(request.url.path) if s in keys]
        ok = [hmac.compare_digest(given, e) for e in _bearer(keys, scopes)]
        request.state.scope = scopes[ok.index(True)] if any(ok) else None
        if not any(ok):
            scope = " or ".join(scope_of(request.url.path))
            raise HTTPException(
                401, f"missing or wrong 'Authorization: Bearer <key>': this route needs the "
                f"run's {scope} key"
            )  # fmt: skip

    check.__annotations__["request"] = Request  # FastAPI injects by the annotation's class
    return check


class ScopedAuth(httpx.Auth):
    """httpx authentication sending each request with its route's key (`scope_of`), of the
    keys this client holds; a route none of them opens is sent without one (and refused)."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self.keys = dict(keys)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        for scope in scope_of(request.url.path):
            if scope in self.keys and "Authorization" not in request.headers:
                request.headers["Authorization"] = f"Bearer {self.keys[scope]}"
                break
        yield request

    def header(self, path: str) -> dict[str, str]:
        """The Authorization header for `path` (for a client that sets headers itself)."""
        scope = next((s for s in scope_of(path) if s in self.keys), None)
        return {"Authorization": f"Bearer {self.keys[scope]}"} if scope else {}
