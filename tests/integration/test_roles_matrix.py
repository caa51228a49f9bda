"""Least-privilege roles, exactly: the catalog holds each level's privileges and no other, and
every one of them is needed by that level's job.

`EXPECTED` is written out here, independently of `sqlalchemy_pgtask.grants`: granting one
privilege more (on a table, a column, a sequence, a function or the schema) or one less fails
`test_the_catalog_holds_exactly_the_expected_privileges`; and for each privilege granted,
`test_each_granted_privilege_is_needed_by_the_job` revokes that one alone and shows the level's
job (the statements the library runs for it, `tests.support.roles.JOBS`) refused.

Both run in one transaction that is rolled back: a role made in it, granted, and acted as
(``SET LOCAL ROLE``), so the many cases share one database and leave nothing behind.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, create_engine

from sqlalchemy_pgtask.grants import LEVELS, grant_roles
from sqlalchemy_pgtask.testing import ServerInfo, create_database, drop_database
from tests.support.roles import DENIED, ddl, expand, privileges_of, quoted, run_job, temporary_role

_COMMON = ("schema pgtask: USAGE", "function pgtask.now(): EXECUTE")

#: The tables every read model reads.
_READ = tuple(
    f"{table}: SELECT"
    for table in (
        "tasks", "attempts", "checkpoints", "waits", "workers", "worker_capabilities", "queues",
        "capacity_releases", "schedules", "audit_log", "idempotency_keys",
    )
)

EXPECTED: dict[str, tuple[str, ...]] = {
    "producer": (
        *_COMMON,
        "tasks: SELECT",
        "tasks: INSERT (id queue name version payload headers priority max_attempts run_at"
        " timeout_seconds idempotency_key concurrency_key concurrency_limit)",
        "idempotency_keys: SELECT",
        "idempotency_keys: INSERT (queue key task_id)",
        "idempotency_keys: UPDATE (task_id created_at expires_at)",
        "queues: SELECT (name idempotency_retention_seconds)",
        "signals: SELECT",
        "signals: INSERT",
        "signals: UPDATE (value)",
        "checkpoints: SELECT",
        "waits: SELECT",
    ),
    "worker": (
        *_COMMON,
        "function pgtask.concurrency_admits(uuid): EXECUTE",
        "tasks: SELECT",
        "tasks: INSERT (id queue name version payload headers priority max_attempts run_at"
        " timeout_seconds parent_id schedule_name scheduled_for concurrency_key"
        " concurrency_limit)",
        "tasks: UPDATE (state run_at attempt failed_attempts max_attempts lease_token"
        " lease_owner lease_expires_at cancel_requested_at result error completed_at"
        " updated_at has_children retry_kind retry_base_seconds retry_factor"
        " retry_max_seconds retry_jitter concurrency_held)",
        "tasks: DELETE",
        "attempts: SELECT",
        "attempts: INSERT",
        "attempts: UPDATE",
        "checkpoints: SELECT",
        "checkpoints: INSERT",
        "checkpoints: UPDATE (value)",
        "waits: SELECT",
        "waits: INSERT",
        "signals: SELECT",
        "workers: SELECT",
        "workers: INSERT",
        "workers: UPDATE",
        "workers: DELETE",
        "worker_capabilities: SELECT",
        "worker_capabilities: INSERT",
        "worker_capabilities: DELETE",
        "handler_policies: SELECT",
        "handler_policies: INSERT",
        "handler_policies: UPDATE (max_attempts)",
        "queues: SELECT",
        "rate_buckets: SELECT",
        "rate_buckets: INSERT",
        "rate_buckets: UPDATE",
        "idempotency_keys: SELECT",
        "idempotency_keys: DELETE",
        "idempotency_keys: UPDATE (created_at)",
        "schedules: SELECT",
        "schedules: INSERT",
        "schedules: UPDATE (cron interval_seconds timezone misfire catch_up_limit overlap queue"
        " task_name version payload headers priority max_attempts timeout_seconds declared"
        " next_run_at last_task_id last_error updated_at concurrency_key concurrency_limit)",
    ),
    "observer": (*_COMMON, *_READ),
    "admin": (
        *_COMMON,
        *_READ,
        "tasks: UPDATE (state run_at failed_attempts cancel_requested_at result error"
        " completed_at updated_at lease_token lease_owner lease_expires_at)",
        "tasks: DELETE",
        "idempotency_keys: DELETE",
        "idempotency_keys: UPDATE (created_at)",
        "workers: DELETE",
        "workers: UPDATE (started_at)",
        "queues: INSERT (name)",  # a new queue's row is created bare, its settings updated
        "queues: UPDATE (max_outstanding_tasks terminal_retention_seconds"
        " idempotency_retention_seconds paused_at updated_at rate_limit rate_period_seconds"
        " starvation_timeout_seconds)",
        "schedules: INSERT",
        "schedules: UPDATE",
        "schedules: DELETE",
        "audit_log: INSERT (actor action task_id queue schedule reason details)",
    ),
}


@pytest.fixture(scope="module")
def shared_engine(pgtask_server: ServerInfo, pgtask_template_database: str) -> Iterator[Engine]:
    """One migrated database for the module: every test here rolls its transaction back."""
    url = create_database(pgtask_server.url, "pgtask_roles", template=pgtask_template_database)
    engine = create_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()
        drop_database(url)


@pytest.fixture
def owner(shared_engine: Engine) -> Iterator[Connection]:
    """A connection as the schema's owner in a transaction that is always rolled back."""
    with shared_engine.connect() as connection:
        connection.begin()
        try:
            yield connection
        finally:
            connection.rollback()


def _revoke(privilege: str, role: str) -> str:
    """The REVOKE of one privilege as `privileges_of` writes it."""
    target, _, what = privilege.partition(": ")
    if target == "schema pgtask":
        return f"REVOKE {what} ON SCHEMA pgtask FROM {role}"
    if target.startswith("function "):
        return f"REVOKE {what} ON FUNCTION {target.removeprefix('function ')} FROM {role}"
    return f"REVOKE {what} ON pgtask.{target} FROM {role}"


@pytest.mark.parametrize("level", LEVELS)
def test_the_catalog_holds_exactly_the_expected_privileges(owner: Connection, level: str) -> None:
    role = temporary_role(owner, level)
    grant_roles(owner, **{level: role})
    assert sorted(privileges_of(owner, role)) == sorted(expand(EXPECTED[level]))


def test_a_role_given_no_level_holds_nothing_in_the_schema(owner: Connection) -> None:
    """What PUBLIC had (EXECUTE on every function; the migration already took it away from
    the SECURITY DEFINER ones a role could call) is revoked, so a role the grants never named
    can do nothing there."""
    bystander = temporary_role(owner, "bystander")
    before = privileges_of(owner, bystander)
    assert "function pgtask.now(): EXECUTE" in before
    assert "function pgtask.admit(text[],bigint[]): EXECUTE" not in before
    grant_roles(owner, producer=temporary_role(owner, "producer"))
    assert privileges_of(owner, bystander) == set()


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_does_its_whole_job_with_its_grants(owner: Connection, level: str) -> None:
    role = temporary_role(owner, level)
    grant_roles(owner, **{level: role})
    assert run_job(owner, level, role) == {}


@pytest.mark.parametrize(
    ("level", "privilege"),
    [(level, privilege) for level in LEVELS for privilege in sorted(expand(EXPECTED[level]))],
)
def test_each_granted_privilege_is_needed_by_the_job(
    owner: Connection, level: str, privilege: str
) -> None:
    role = temporary_role(owner, level)
    grant_roles(owner, **{level: role})
    ddl(owner, _revoke(privilege, quoted(role)))
    assert privilege not in privileges_of(owner, role)
    failures = run_job(owner, level, role)
    assert DENIED in failures.values(), f"nothing refused without {privilege}: {failures}"
