"""The web console's page and assets (index.html, console.js, console.css),
kept in the package so it works from an installed wheel on a broker without
internet access: no CDN, no font, no library; the charts are plain SVG.

``asset(name)`` reads one (once: they are cached) for the API's ``GET /``
and ``GET /console/{name}`` routes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

# The files served, with their media types: nothing else in this directory is reachable.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}

# The page may load its own scripts and styles and talk to its own origin, and nothing else;
# no page may frame it (so the delete button cannot be clickjacked).
SECURITY_HEADERS = [
    ("content-security-policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
]


@cache
def asset(name: str) -> tuple[bytes, str] | None:
    """(content, media type) of a console file, or None if there is no such file."""
    media_type = ASSETS.get(name)
    if media_type is None:
        return None
    return resources.files(__name__).joinpath(name).read_bytes(), media_type
