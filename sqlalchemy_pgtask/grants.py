"""grants: least-privilege access to the pgtask schema for four kinds of database role; runs
GRANT statements in the caller's transaction and never commits, never creates a role.

The four levels, each the privileges of the library calls that level makes and nothing more:

* **producer**: enqueues (idempotency keys and capacity-limited queues included), emits
  signals, reads tasks (`get_task`, `wait_for_result`, ``status.list_tasks``);
* **worker**: runs a `Worker` and its maintenance (claims, leases, outcomes, recovery, durable
  steps, sleeps, signal and child waits, spawns, wait timeouts, worker rows, schedules,
  retention, rate-limit buckets);
* **observer**: reads what ``pgtask status``, ``task list|show``, ``queue list``, the schedule
  list, the audit log and the read-only dashboard (its search by idempotency key included)
  show; writes nothing;
* **admin**: cancels and retries tasks, pauses, resumes and configures queues, manages
  schedules, runs retention, reads what the observer reads; appends to the audit log (which
  nobody can change: its trigger refuses UPDATE, DELETE and TRUNCATE).

Every level gets USAGE on schema ``pgtask`` and EXECUTE on ``pgtask.now()`` (the worker also
on ``pgtask.concurrency_admits(uuid)``, which its claim calls). What PUBLIC would
otherwise have on the schema, its tables, sequences and functions is revoked first: PostgreSQL
lets PUBLIC execute every new function, the ``SECURITY DEFINER`` trigger helpers included.
Triggers write the tables nobody is granted (``capacity_releases``, the capacity counter,
key expiries, signal and child wake-ups, cascading cancellation) as their owner, and foreign
key cascades run as the table owner, so no level needs a privilege for them. No level needs a
sequence: identity columns draw their values without one.

Grants are additive. Never give one role two levels: it would hold the union. To take a level
away, ``REVOKE ALL ON ALL TABLES IN SCHEMA pgtask FROM role`` (and the schema's USAGE, and
EXECUTE on all functions in the schema), then grant the level it keeps. Run this as the
schema's owner (the role that ran the migrations).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from psycopg import sql
from sqlalchemy import Connection

from sqlalchemy_pgtask._connection import (
    AsyncBind,
    SyncBind,
    async_bind,
    async_connection_of,
    connection_of,
    sync_bind,
    translated_errors,
)
from sqlalchemy_pgtask.errors import InvalidNameError, InvalidOptionError

__all__ = [
    "FUNCTIONS", "LEVELS", "PRIVILEGES", "TableGrant", "grant_roles", "grant_roles_async",
    "grants_sql",
]

SCHEMA: Final = "pgtask"

#: The levels, in the order their statements are written.
LEVELS: Final = ("producer", "worker", "observer", "admin")

#: PostgreSQL's limit on an identifier (NAMEDATALEN - 1 bytes).
ROLE_NAME_MAX_BYTES: Final = 63


@dataclass(frozen=True, slots=True)
class TableGrant:
    """One privilege on one pgtask table: on the whole table, or only on ``columns``."""

    privilege: str
    table: str
    columns: tuple[str, ...] = ()


def _on(table: str, *privileges: str) -> tuple[TableGrant, ...]:
    return tuple(TableGrant(privilege, table) for privilege in privileges)


def _columns(privilege: str, table: str, columns: str) -> TableGrant:
    return TableGrant(privilege, table, tuple(columns.split()))


#: What an enqueue writes (`statements.ENQUEUE_*`): never a state, lease, result or parent.
_ENQUEUED: Final = (
    "id queue name version payload headers priority max_attempts run_at timeout_seconds"
    " idempotency_key concurrency_key concurrency_limit"
)

#: The tables every read model reads (status, task detail, queue list, schedules, audit, and
#: the dashboard's task search by idempotency key).
_READ: Final = (
    "tasks", "attempts", "checkpoints", "waits", "workers", "worker_capabilities", "queues",
    "capacity_releases", "schedules", "audit_log", "idempotency_keys",
)

#: Retention locks the keys it deletes (``FOR UPDATE SKIP LOCKED``), which PostgreSQL allows
#: only with UPDATE on some column: the one column no decision reads.
_KEY_LOCK: Final = _columns("UPDATE", "idempotency_keys", "created_at")

#: Each level's privileges. Column lists where the level must not touch the other columns:
#: a producer never writes a task's state or lease, a worker never a task's payload or
#: identity, an administrator never a lease or the capacity counter.
PRIVILEGES: Final[Mapping[str, tuple[TableGrant, ...]]] = {
    "producer": (
        *_on("tasks", "SELECT"),
        _columns("INSERT", "tasks", _ENQUEUED),
        *_on("idempotency_keys", "SELECT"),
        # ``idempotency_keys_reserved_task`` (pgtask_0015) checks at commit that the key's
        # task exists with that queue and key: a key is reserved only with its own task.
        _columns("INSERT", "idempotency_keys", "queue key task_id"),
        # Taking over an expired key (`statements.TAKE_OVER_KEYS`); the table's triggers
        # (pgtask_0014) refuse any other update: a live key is never extended, released or
        # re-pointed, and a key is taken over only for a new task with that key.
        _columns("UPDATE", "idempotency_keys", "task_id created_at expires_at"),
        # An expired key is judged by its queue's idempotency retention.
        _columns("SELECT", "queues", "name idempotency_retention_seconds"),
        *_on("signals", "SELECT", "INSERT"),
        # ON CONFLICT DO UPDATE SET value = value: the first value wins, and is returned.
        _columns("UPDATE", "signals", "value"),
        # get_task loads the steps and the wait.
        *_on("checkpoints", "SELECT"),
        *_on("waits", "SELECT"),
    ),
    "worker": (
        *_on("tasks", "SELECT"),
        # Children (`statements.SPAWN`) and schedule occurrences.
        _columns(
            "INSERT", "tasks",
            "id queue name version payload headers priority max_attempts run_at timeout_seconds"
            " parent_id schedule_name scheduled_for concurrency_key concurrency_limit",
        ),
        _columns(
            "UPDATE", "tasks",
            "state run_at attempt failed_attempts max_attempts lease_token lease_owner"
            " lease_expires_at cancel_requested_at result error completed_at updated_at"
            " has_children retry_kind retry_base_seconds retry_factor retry_max_seconds"
            " retry_jitter concurrency_held",
        ),
        # Retention; ``tasks_delete_retained`` (pgtask_0015) refuses a task not finished, or
        # finished within its queue's terminal retention.
        *_on("tasks", "DELETE"),
        *_on("attempts", "SELECT", "INSERT", "UPDATE"),
        *_on("checkpoints", "SELECT", "INSERT"),
        # ON CONFLICT DO UPDATE SET value = value (a sleep, a signal wait): the first value
        # wins; ``checkpoints_immutable`` (pgtask_0014) refuses any change.
        _columns("UPDATE", "checkpoints", "value"),
        *_on("waits", "SELECT", "INSERT"),
        *_on("signals", "SELECT"),
        *_on("workers", "SELECT", "INSERT", "UPDATE", "DELETE"),
        *_on("worker_capabilities", "SELECT", "INSERT", "DELETE"),
        *_on("handler_policies", "SELECT", "INSERT"),
        # A policy never changes once frozen, but for a max_attempts frozen as NULL.
        _columns("UPDATE", "handler_policies", "max_attempts"),
        *_on("queues", "SELECT"),
        *_on("rate_buckets", "SELECT", "INSERT", "UPDATE"),
        *_on("idempotency_keys", "SELECT", "DELETE"),
        _KEY_LOCK,
        # Materialising (cursor, last task, last error) and reconciling declared schedules
        # (their definitions); never pausing, resuming or deleting one.
        *_on("schedules", "SELECT", "INSERT"),
        _columns(
            "UPDATE", "schedules",
            "cron interval_seconds timezone misfire catch_up_limit overlap queue task_name"
            " version payload headers priority max_attempts timeout_seconds declared"
            " next_run_at last_task_id last_error updated_at concurrency_key concurrency_limit",
        ),
    ),
    "observer": tuple(TableGrant("SELECT", table) for table in _READ),
    "admin": (
        *(TableGrant("SELECT", table) for table in _READ),
        # Cancel, and retry (which clears the lease); never the payload or the identity.
        _columns(
            "UPDATE", "tasks",
            "state run_at failed_attempts cancel_requested_at result error completed_at"
            " updated_at lease_token lease_owner lease_expires_at",
        ),
        # Retention; ``tasks_delete_retained`` (pgtask_0015) refuses a task not finished, or
        # finished within its queue's terminal retention.
        *_on("tasks", "DELETE"),
        *_on("idempotency_keys", "DELETE"),
        _KEY_LOCK,
        # Retention of every queue prunes worker rows, locked like the keys.
        *_on("workers", "DELETE"),
        _columns("UPDATE", "workers", "started_at"),
        # Settings only: the capacity counter is the triggers' business. A new queue's row
        # is created bare, then its settings are written by the UPDATE.
        _columns("INSERT", "queues", "name"),
        _columns(
            "UPDATE", "queues",
            "max_outstanding_tasks terminal_retention_seconds idempotency_retention_seconds"
            " paused_at updated_at rate_limit rate_period_seconds starvation_timeout_seconds",
        ),
        *_on("schedules", "INSERT", "UPDATE", "DELETE"),
        # Append-only: the table's trigger refuses UPDATE, DELETE and TRUNCATE anyway. Never
        # ``id`` or ``occurred_at``: the database numbers and dates every entry, so none can
        # be backdated or slipped in before another (OVERRIDING SYSTEM VALUE).
        _columns("INSERT", "audit_log", "actor action task_id queue schedule reason details"),
    ),
}

#: The functions a level calls besides ``pgtask.now()``: the claim asks whether a keyed task
#: may take its concurrency key (revision pgtask_0016).
FUNCTIONS: Final[Mapping[str, tuple[str, ...]]] = {
    "worker": ("concurrency_admits(uuid)",),
}

#: Revoked from PUBLIC before anything is granted: nothing in the schema is anyone's by default.
_PUBLIC_REVOKES: Final = (
    f"REVOKE ALL ON SCHEMA {SCHEMA} FROM PUBLIC",
    f"REVOKE ALL ON ALL TABLES IN SCHEMA {SCHEMA} FROM PUBLIC",
    f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {SCHEMA} FROM PUBLIC",
    f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {SCHEMA} FROM PUBLIC",
)

def _quoted(name: str) -> str:
    """``name`` as a quoted identifier (by psycopg: quotes doubled), whatever it holds."""
    return sql.Identifier(name).as_string(None)


def _check_role(level: str, value: object) -> str:
    """A role name PostgreSQL accepts as a role that is not PUBLIC or a predefined role."""
    if not isinstance(value, str):
        raise InvalidNameError(level, f"must be a role name (str), got {type(value).__name__}")
    if not value or value.strip() != value:
        raise InvalidNameError(level, "must be a role name without surrounding spaces")
    if "\x00" in value:
        raise InvalidNameError(level, "must not contain NUL characters")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidNameError(level, "is not valid UTF-8") from exc
    if size > ROLE_NAME_MAX_BYTES:
        raise InvalidNameError(
            level, f"is {size} bytes long; PostgreSQL role names have at most 63"
        )
    # Even quoted, "public" means PUBLIC and "none" is reserved; pg_* are predefined roles.
    if value.lower() in ("public", "none") or value.lower().startswith("pg_"):
        raise InvalidNameError(
            level, f"{value!r} is PUBLIC, reserved or a predefined role: name a role you created"
        )
    return value


def _roles(**roles: object) -> dict[str, str]:
    """The given levels' roles, checked; raises before any SQL."""
    chosen = {
        level: _check_role(level, roles[level]) for level in LEVELS if roles[level] is not None
    }
    if not chosen:
        raise InvalidOptionError("roles", "name at least one of producer, worker, observer, admin")
    seen: dict[str, str] = {}
    for level, role in chosen.items():
        if role in seen:
            raise InvalidOptionError(
                level,
                f"role {role!r} is also the {seen[role]}: grants add up, so one role for two"
                " levels would hold both; use one role per level",
            )
        seen[role] = level
    return chosen


def _grant(grant: TableGrant, role: str) -> str:
    columns = f" ({', '.join(grant.columns)})" if grant.columns else ""
    return f"GRANT {grant.privilege}{columns} ON {SCHEMA}.{grant.table} TO {role}"


def _statements(roles: Mapping[str, str]) -> list[str]:
    statements = list(_PUBLIC_REVOKES)
    for level, name in roles.items():
        role = _quoted(name)
        statements.append(f"GRANT USAGE ON SCHEMA {SCHEMA} TO {role}")
        statements.append(f"GRANT EXECUTE ON FUNCTION {SCHEMA}.now() TO {role}")
        statements.extend(
            f"GRANT EXECUTE ON FUNCTION {SCHEMA}.{function} TO {role}"
            for function in FUNCTIONS.get(level, ())
        )
        statements.extend(_grant(grant, role) for grant in PRIVILEGES[level])
    return statements


def grants_sql(
    *,
    producer: str | None = None,
    worker: str | None = None,
    observer: str | None = None,
    admin: str | None = None,
) -> str:
    """The statements `grant_roles` runs, as SQL text (one statement a line), to review or run
    with psql as the schema's owner.

    :raises ValidationError: no role, a role given for two levels, or a name that is not a
        role's (empty, over 63 bytes, NUL, ``public``, ``none``, ``pg_*``).
    """
    roles = _roles(producer=producer, worker=worker, observer=observer, admin=admin)
    return "".join(f"{statement};\n" for statement in _statements(roles))


#: Send the text as it is: with parameters (even none), psycopg reads ``%s`` as a placeholder.
_VERBATIM: Final = {"no_parameters": True}


def _run(connection: Connection, statements: list[str]) -> None:
    with translated_errors(connection):
        for statement in statements:
            # Role names are quoted identifiers (psycopg); there is nothing to bind, and
            # without parameters the driver leaves a '%' in a name alone.
            connection.exec_driver_sql(statement, execution_options=_VERBATIM)


def grant_roles(
    bind: SyncBind,
    *,
    producer: str | None = None,
    worker: str | None = None,
    observer: str | None = None,
    admin: str | None = None,
) -> None:
    """Grant each given role its level's privileges, in ``bind``'s transaction; never commits.

    The roles must exist (``CREATE ROLE ... LOGIN``); run as the schema's owner. Revokes what
    PUBLIC has on the schema first. Grants add to what a role already holds.

    :raises ValidationError: as `grants_sql`, before any SQL.
    """
    target = sync_bind(bind, "grant_roles")
    statements = _statements(
        _roles(producer=producer, worker=worker, observer=observer, admin=admin)
    )
    _run(connection_of(target), statements)


async def grant_roles_async(
    bind: AsyncBind,
    *,
    producer: str | None = None,
    worker: str | None = None,
    observer: str | None = None,
    admin: str | None = None,
) -> None:
    """`grant_roles` for an `AsyncSession` or `AsyncConnection`."""
    target = async_bind(bind, "grant_roles")
    statements = _statements(
        _roles(producer=producer, worker=worker, observer=observer, admin=admin)
    )
    connection = await async_connection_of(target)
    await connection.run_sync(_run, statements)
