"""Shared test configuration.

Database fixtures come from the ``sqlalchemy_pgtask.testing`` plugin, which the package
registers with pytest (entry point ``pytest11``), exactly as users of the library get them.
Fixtures more than one suite needs are here; helpers are in ``tests/support``.

Markers for the fast inner loop (``pytest -n auto -m "not processes and not slow"``, see
docs/testing.md): `pytest_collection_modifyitems` marks ``processes`` every test that starts a
process of its own beyond the test database (a worker, a dashboard, a browser, a PostgreSQL
server, PgBouncer, the ``pgtask`` or ``alembic`` command, a wheel build), by directory or
module, and every test that uses the browser fixture, so a new test in those places is
marked without remembering to. ``slow`` is set by
hand on the few in-process tests that take seconds each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from sqlalchemy import Engine

from tests.support.engines import engine_for

_TESTS: Final = Path(__file__).resolve().parent

#: Where every test starts a process of its own: whole directories, then single modules.
PROCESS_DIRECTORIES: Final = ("acceptance", "migrations")
#: A test using this fixture drives Chromium (tests/dashboard/conftest.py), wherever it is.
BROWSER_FIXTURE: Final = "playwright_instance"
PROCESS_MODULES: Final = (
    "dashboard/test_browser.py",  # Chromium
    "integration/test_server.py",  # PostgreSQL servers of its own
    "integration/test_roles_cli.py",  # the pgtask command
    "integration/test_schedule_cli.py",  # the pgtask command
)

#: In-process tests that take seconds each (a dead path's deadlines, races run many times, a
#: held row waited out, a brute-force reference): the slowest of an inner loop's run, so the
#: inner loop leaves them to the full suite. Whole modules, then single test functions.
SLOW_MODULES: Final = (
    "integration/test_dead_path.py",
    "integration/test_durable_races.py",
    "integration/test_roles.py",  # roles made, granted and dropped per test
    "integration/test_roles_least_privilege.py",
    "integration/test_roles_matrix.py",
    "integration/test_roles_read_models.py",
    "integration/test_roles_signal_rewrites.py",
    "integration/test_stuck_handlers.py",
)
SLOW_TESTS: Final = (
    "dashboard/test_refusals.py::test_an_action_without_a_matching_csrf_token_is_refused_with_403_and_writes_nothing",
    "dashboard/test_refusals.py::test_an_action_without_authority_is_refused_with_403_and_writes_nothing",
    "integration/test_blocking.py::test_a_long_transaction_over_running_tasks_never_leads_to_two_executions",
    "integration/test_blocking.py::test_turning_a_capacity_on_gives_up_rather_than_queue_every_writer_behind_it",
    "integration/test_drain_due_work.py::test_drain_after_the_clock_passes_a_declared_schedule_runs_its_occurrence",
    "integration/test_drain_due_work.py::test_drain_materialises_and_runs_a_due_schedule",
    "integration/test_drain_due_work.py::test_drain_runs_a_task_whose_signal_wait_timed_out",
    "integration/test_durable.py::test_a_suspended_task_resumes_only_on_its_own_handler_version",
    "integration/test_durable.py::test_waiting_for_a_task_that_is_not_a_direct_child_is_refused",
    "integration/test_outcome_writer_faults.py::test_an_outcome_always_past_statement_timeout_is_given_up_and_its_task_recovered",
    "integration/test_outcome_writer_faults.py::test_an_outcome_whose_waiting_parent_stays_locked_is_given_up_within_a_lease",
    "integration/test_prefetch.py::test_a_queue_that_becomes_governed_is_never_claimed_ahead",
    "integration/test_prefetch.py::test_a_task_claimed_ahead_that_waits_too_long_is_handed_back_unspent",
    "integration/test_rate_limits.py::test_claimers_serving_governed_queues_in_opposite_orders_never_deadlock",
    "integration/test_retention.py::test_a_worker_drains_while_a_retention_batch_is_held_open",
    "integration/test_retention_families.py::test_a_history_row_held_by_another_transaction_holds_up_no_other_deletion",
    "integration/test_status_held_back.py::test_a_wait_timeout_a_held_row_keeps_from_being_applied_is_shown_held_back",
    "integration/test_wait_timeouts_held.py::test_a_wait_past_statement_timeout_is_set_aside_within_the_passs_deadline",
    "integration/test_wait_timeouts_worker.py::test_an_unrelated_signal_timeout_fires_while_another_timeouts_subtree_is_held",
    "integration/test_worker.py::test_a_worker_registers_its_capabilities_heartbeats_and_retires_on_shutdown",
    "integration/test_worker.py::test_an_exception_that_cannot_be_printed_still_fails_the_attempt",
    "integration/test_worker.py::test_lease_renewal_keeps_a_long_handler_alive_past_three_lease_durations",
    "integration/test_durable_matrix.py::test_parent_terminal_failure_before_commit_leaves_parent_and_children_unchanged",
    "integration/test_runtime_faults.py::test_a_handler_raising_cancelled_error_itself_is_a_failure_retried_by_policy",
    "integration/test_time_limits.py::test_a_handler_within_its_limit_succeeds_and_records_its_deadline",
    "integration/test_worker_contract.py::test_a_retry_an_hour_later_runs_once_the_database_clock_moves_an_hour",
    "integration/test_worker_contract.py::test_an_expired_lease_is_recovered_once_the_database_clock_passes_it",
    "integration/test_worker_contract.py::test_every_statement_the_worker_executes_binds_exactly_what_it_declares",
    "integration/test_worker.py::test_an_unstorable_result_is_a_terminal_result_rejected_failure",
    "integration/test_worker.py::test_claims_never_exceed_the_concurrency",
    "integration/test_worker.py::test_int_and_float_retry_delays_are_written_in_one_batch",
    "integration/test_worker.py::test_shutdown_drains_a_handler_that_finishes_within_the_grace_period",
    "integration/test_worker.py::test_shutdown_hands_back_a_task_that_outlives_the_grace_period",
    "unit/test_cron_reference.py::test_cron_occurrences_match_an_independent_brute_force_reference",
    "unit/test_outcome.py::test_a_huge_traceback_is_cut_from_the_front_keeping_the_innermost_frames",
    "unit/test_outcome.py::test_error_document_fits_256_kib_even_for_a_10_mb_message",
)


def _relative(path: Path) -> str | None:
    try:
        return path.resolve().relative_to(_TESTS).as_posix()
    except ValueError:
        return None


def needs_processes(path: Path) -> bool:
    """Whether the test module at ``path`` starts processes (see the module's docstring)."""
    relative = _relative(path)
    if relative is None:
        return False
    return relative.split("/", 1)[0] in PROCESS_DIRECTORIES or relative in PROCESS_MODULES


def is_slow(path: Path, function: str) -> bool:
    """Whether the test ``function`` of the module at ``path`` is listed as slow."""
    relative = _relative(path)
    return relative in SLOW_MODULES or f"{relative}::{function}" in SLOW_TESTS


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        uses_browser = BROWSER_FIXTURE in getattr(item, "fixturenames", ())
        if uses_browser or needs_processes(item.path):
            item.add_marker(pytest.mark.processes)
        function = getattr(item, "originalname", item.name)
        if is_slow(item.path, function):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def empty_engine(pgtask_empty_database_url: str) -> Iterator[Engine]:
    """A sync engine on this test's empty database (nothing installed)."""
    with engine_for(pgtask_empty_database_url) as engine:
        yield engine
