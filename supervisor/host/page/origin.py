"""Whether a request to the page's API came from the page itself, as the browser says (pure).

A browser says where a request came from in `Sec-Fetch-Site` (every current browser: `same-origin`
only for the page's own origin, `none` for what the user typed or bookmarked) and, on a POST or a
cross-origin request, in `Origin`. Cookies carry no port, so another service on the same host (an
engine's web UI, a Grafana) is the same *site*, and its scripts' requests carry the page's
cookie: only the *origin* tells them apart. A request that says nothing (curl, a script) is no
browser's and is judged by its cookie and CSRF token alone.

`Origin` is compared with the request's `Host` (host and port, a scheme's default port filled
in from the Origin's scheme), not with the scheme the gateway serves: behind a reverse proxy
that ends TLS the gateway sees http while the browser says https.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import urlsplit

SAME: Final = frozenset({"same-origin", "none"})
DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def foreign(sec_fetch_site: str | None, origin: str | None, host: str) -> str | None:
    """Why a request came from elsewhere than the page (another site, or another origin on the
    same site), or None when nothing says it did."""
    if sec_fetch_site is not None and sec_fetch_site.strip().lower() not in SAME:
        return f"Sec-Fetch-Site says {sec_fetch_site.strip()[:40]!r}"
    if origin is not None and not same_origin(origin, host):
        return f"its Origin {origin.strip()[:200]!r} is not this page's"
    return None


def same_origin(origin: str, host: str) -> bool:
    """Whether an Origin header names the host and port of the Host header."""
    try:
        theirs = urlsplit(origin.strip())
        scheme = theirs.scheme.lower()
        if scheme not in DEFAULT_PORTS or not theirs.hostname or theirs.path or theirs.query:
            return False  # "null", a path, or no web origin at all
        ours = urlsplit("//" + host.strip())
        if not ours.hostname:
            return False
        default = DEFAULT_PORTS[scheme]
        return (theirs.hostname, theirs.port or default) == (ours.hostname, ours.port or default)
    except ValueError:  # a port that is no number, a broken IPv6 literal
        return False
