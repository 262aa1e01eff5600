"""The page `dspark serve` shows at `/`: a chat whose answer marks every token by origin (drafted
and accepted, corrected by the target, the target's bonus, plain), beside the server's live
speculative statistics. Three static files in the package (static/), no build step, nothing
from a CDN: it works offline. It reads the API through the stream extension (protocol.MARKS) and
/v1/dspark/stats, sending the API key the user types when the server has one.

The Content-Security-Policy allows scripts and styles from this server only (no inline code):
model output is untrusted text, and the page writes it with textContent, never as HTML.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

FILES = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def read(name: str) -> str:
    return resources.files("dspark.serve").joinpath("static", name).read_text(encoding="utf-8")


def html() -> str:
    return read("index.html")
