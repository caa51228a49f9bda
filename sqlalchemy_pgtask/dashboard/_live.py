"""dashboard._live: live refresh of a page's region without a reload, by polling.

A page marks one region (a ``data-live`` element whose content is the template's ``live``
block). ``static/live.js`` fetches the page's own URL with the `FRAGMENT_HEADER` header every
`Dashboard.live_interval` seconds while the tab is visible, and the server answers with that
block alone: the same query and the same template as the full page, so the region can never
show something the page would not. Without JavaScript the pages are what they were; the
script is a static file, so the CSP keeps ``script-src 'self'`` with no inline script.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import jinja2
from starlette.requests import Request

__all__ = [
    "FRAGMENT_HEADER",
    "FRAGMENT_VALUE",
    "LIVE_BLOCK",
    "LIVE_INTERVAL",
    "LIVE_INTERVAL_MAX",
    "LIVE_INTERVAL_MIN",
    "check_live_interval",
    "render_fragment",
    "wants_fragment",
]

#: The request header (and its value) that asks for the live region alone; the response
#: carries it back, so the script can tell a fragment from a full page (a login redirect, an
#: error page) and leave the region as it is.
FRAGMENT_HEADER: Final = "x-pgtask-fragment"
FRAGMENT_VALUE: Final = "live"
#: The template block that holds a page's live region.
LIVE_BLOCK: Final = "live"
#: Seconds between refreshes unless told otherwise; 0 turns live refresh off. Faster than one
#: a second would be a load of its own on the database; slower than an hour is not live.
LIVE_INTERVAL: Final = 5.0
LIVE_INTERVAL_MIN: Final = 1.0
LIVE_INTERVAL_MAX: Final = 3600.0


def check_live_interval(value: object) -> float:
    """``value`` as seconds between refreshes: 0 (off), or 1 to 3600; else `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"live_interval must be seconds, got {value!r}")
    if value != 0 and not LIVE_INTERVAL_MIN <= value <= LIVE_INTERVAL_MAX:
        raise ValueError(f"live_interval must be 0 (off) or 1 to 3600 seconds, got {value!r}")
    return float(value)


def wants_fragment(request: Request) -> bool:
    """Whether ``request`` is the script's, asking for the live region alone."""
    return request.headers.get(FRAGMENT_HEADER, "").strip().lower() == FRAGMENT_VALUE


def render_fragment(template: jinja2.Template, context: Mapping[str, Any]) -> str | None:
    """The ``live`` block of ``template`` rendered with ``context``; None if it has none.

    A block rendered alone does not see the template's top-level imports: a live block
    imports the macros it uses itself.
    """
    block = template.blocks.get(LIVE_BLOCK)
    if block is None:
        return None
    return "".join(block(template.new_context(dict(context))))
