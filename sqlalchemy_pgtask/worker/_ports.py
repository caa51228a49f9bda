"""worker._ports: what a part needs of an object that lives above it, as a protocol.

The parts of the worker import nothing above them; where one works with an object of a higher
module, it names what it uses here, and the higher module's class fits it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sqlalchemy_pgtask.durable.context import BaseTaskContext
    from sqlalchemy_pgtask.statements import Lease

__all__ = ["CallOwner"]


class CallOwner(Protocol):
    """The attempt a durable call runs for (a `DurableAttempt`), as `DurableCalls` and the
    transaction steps use it."""

    #: A call of this attempt was sent again after a transient failure.
    retried: bool

    @property
    def lease(self) -> Lease: ...
    @property
    def ctx(self) -> BaseTaskContext: ...
