"""The handlers that ``test_shop_tasks.py`` tests: an application's own task module.

``notify-shipping`` asks the carrier to collect a parcel. The carrier (a stand-in here)
answers "busy" to the first request for a parcel marked ``"busy_first": true``: the handler
then retries in ten minutes. A parcel without an address can never be collected: the task
fails at once rather than using up its retries.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy_pgtask import Fail, Registry, Retry, RetryPolicy, TaskContext

registry = Registry()

#: How long the carrier asks us to wait when it is busy, in seconds.
BUSY_DELAY = 600.0


@registry.task("notify-shipping", queue="shipping", retry=RetryPolicy.fixed(60.0), max_attempts=5)
async def notify_shipping(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Book a collection for ``payload["parcel"]`` at ``payload["address"]``."""
    if not payload.get("address"):
        raise Fail(f"parcel {payload['parcel']} has no address")
    if payload.get("busy_first") and ctx.attempt == 1:
        raise Retry("the carrier is busy", delay=BUSY_DELAY)
    return {"parcel": payload["parcel"], "booked_on_attempt": ctx.attempt}
