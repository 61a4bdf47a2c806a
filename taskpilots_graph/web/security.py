"""The inbox's guards: where it may listen, who may use it, and which forms it accepts.

* **Bind**: loopback (``127.0.0.1``, ``::1``, ``localhost``) by default; any other address
  needs an access token, and :func:`check_bind` refuses to start without one.
* **Access token** (when set): every request carries it, as the ``tp_token`` cookie (set
  after one visit with ``?token=...``) or an ``Authorization: Bearer`` header.
* **CSRF**: every POST carries a form field ``csrf`` equal to an HMAC, under a per-process
  secret, of the browser's ``tp_csrf`` cookie *and the takeover the form answers* (its
  interrupt id); anything else is refused with 403 before a decision is parsed. A
  cross-site page can neither read the token nor set the cookie, and a token cannot be
  moved to another takeover: a form answers the takeover it was rendered for or nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from taskpilots_graph.errors import ConfigurationError

__all__ = [
    "ACCESS_COOKIE",
    "CSRF_COOKIE",
    "CsrfGuard",
    "InsecureBind",
    "check_bind",
    "is_loopback",
    "same_token",
]

CSRF_COOKIE = "tp_csrf"
ACCESS_COOKIE = "tp_token"


class InsecureBind(ConfigurationError):
    """The inbox was asked to listen beyond loopback without an access token."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback ``host`` without an access ``token``.

    Raises:
        InsecureBind: With the fix in the message.
    """
    if token is not None and len(token) < 16:
        raise InsecureBind("the inbox access token must be at least 16 characters long")
    if not is_loopback(host) and not token:
        raise InsecureBind(
            f"refusing to serve the takeover inbox on {host!r} without an access token: "
            "anyone who can reach it could decide runs. Pass --token (at least 16 "
            "characters), or bind to 127.0.0.1"
        )


def same_token(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented token with the expected one."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class CsrfGuard:
    """Issues and checks the CSRF tokens of one inbox process (see the module docstring)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    @staticmethod
    def new_cookie() -> str:
        """A fresh random value for the browser's ``tp_csrf`` cookie."""
        return secrets.token_urlsafe(32)

    def token_for(self, cookie: str, scope: str) -> str:
        """The form token that goes with ``cookie`` for the takeover ``scope``."""
        message = f"{len(cookie)}:{cookie}|{scope}".encode()  # unambiguous concatenation
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def valid(self, cookie: str | None, token: str | None, scope: str | None) -> bool:
        """Whether a POST's ``token`` matches its ``cookie`` and the takeover ``scope``."""
        if not cookie or not token or not scope:
            return False
        return same_token(token, self.token_for(cookie, scope))
