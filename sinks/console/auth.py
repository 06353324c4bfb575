"""The console's session and CSRF tokens: pure functions over the admin token's digest.

Guarantees:

* a session exists only after the admin token was given to the login form: the cookie
  is ``<issued_s>.<nonce>.<mac>``, the MAC an HMAC-SHA256 keyed by the admin token's
  digest (:func:`session_key`), so nothing but the token can make one, the token itself
  is never in the cookie, and a changed token ends every session at once;
* a session lasts :data:`SESSION_MAX_AGE_S` from its login (a cookie from the future,
  beyond :data:`CLOCK_SKEW_S`, is refused too);
* every action carries a CSRF token derived from its session (:func:`csrf_token`): a
  page of another origin can neither read it nor make it; it is checked before the
  action's form or body is read any further;
* every comparison of a secret is constant-time (:func:`hmac.compare_digest` over
  equal-length digests), and no function here logs.

No admin token configured (empty key): no login, no session, no CSRF token is valid.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

#: A session ends this long after its login (a working day).
SESSION_MAX_AGE_S = 8 * 3600
#: A cookie issued up to this far in the future is still taken (clocks of several sinks).
CLOCK_SKEW_S = 60
#: Random bytes of a session's nonce (two logins in one second are two sessions).
NONCE_BYTES = 16
#: Longest cookie value judged (anything longer is refused without a MAC computed).
MAX_COOKIE_CHARS = 200


def session_key(token: str) -> bytes:
    """The key sessions are signed with: a digest of the admin token (empty: no token)."""
    if not token:
        return b""
    return hashlib.sha256(b"outbox-cdc console session\x00" + token.encode()).digest()


def token_matches(given: str, token: str) -> bool:
    """Whether the login form's ``given`` is the admin token (constant time; an empty
    token configured matches nothing)."""
    if not token or not given:
        return False
    a = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
    b = hashlib.sha256(token.encode()).digest()
    return hmac.compare_digest(a, b)


def _mac(key: bytes, message: str) -> str:
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def issue_session(key: bytes, *, now_s: float, nonce: str | None = None) -> str:
    """A new session cookie value, issued at ``now_s``."""
    if not key:
        raise ValueError("no admin token: no session")
    body = f"{int(now_s)}.{nonce or secrets.token_hex(NONCE_BYTES)}"
    return f"{body}.{_mac(key, 'session:' + body)}"


def session_valid(key: bytes, cookie: str | None, *, now_s: float) -> bool:
    """Whether ``cookie`` is a session this key issued, within its age."""
    if not key or not cookie or len(cookie) > MAX_COOKIE_CHARS:
        return False
    issued, dot, rest = cookie.partition(".")
    nonce, dot2, mac = rest.partition(".")
    if not (dot and dot2 and issued.isdigit() and nonce and mac):
        return False
    expected = _mac(key, f"session:{issued}.{nonce}")
    if not hmac.compare_digest(expected.encode(), mac.encode("utf-8", "replace")):
        return False
    age_s = now_s - int(issued)
    return -CLOCK_SKEW_S <= age_s <= SESSION_MAX_AGE_S


def csrf_token(key: bytes, cookie: str) -> str:
    """The CSRF token of a session (what every form and fetch of its pages sends back)."""
    return _mac(key, "csrf:" + cookie)


def csrf_valid(key: bytes, cookie: str | None, given: str | None) -> bool:
    """Whether ``given`` is the CSRF token of the session ``cookie`` (constant time)."""
    if not key or not cookie or not given or len(given) > MAX_COOKIE_CHARS:
        return False
    return hmac.compare_digest(csrf_token(key, cookie).encode(), given.encode("utf-8", "replace"))
