"""The schedules page: each schedule's time zone, misfire and overlap policies, every time
labelled with its zone; pause, resume and run now for admins, audited with the actor, refused
(and nothing written) for anyone else; run now on a role that may not enqueue is a 403 that
says why.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from sqlalchemy import Engine, select
from starlette.testclient import TestClient

from sqlalchemy_pgtask import get_schedule, set_schedule
from sqlalchemy_pgtask.audit import list_audit
from sqlalchemy_pgtask.dashboard import create_app
from sqlalchemy_pgtask.models import Task
from tests.dashboard.conftest import TOKEN, snapshot
from tests.dashboard.seed import Seeded
from tests.dashboard.test_actions import csrf, log_in
from tests.support.roles import login_roles, role_engine


def _berlin(engine: Engine) -> None:
    with engine.begin() as connection:
        set_schedule(connection, "berlin-digest", task="reports.build", cron="0 3 * * *",
                     timezone="Europe/Berlin", queue="reports", misfire="catch_up",
                     catch_up_limit=7, overlap="skip",
                     start_at=datetime(2030, 1, 15, tzinfo=timezone.utc))


def _row(page: str, name: str) -> str:
    start = page.index(f'<tr data-schedule="{name}">')
    return page[start:page.index("</tr>", start)]


def test_page_shows_zone_policies_and_labels_each_time_with_its_zone(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    _berlin(pgtask_engine)

    page = client_for().get("/schedules").text

    berlin = _row(page, "berlin-digest")
    assert '<td data-testid="timezone">Europe/Berlin</td>' in berlin
    assert '<td data-testid="misfire">catch_up (at most 7)</td>' in berlin
    assert '<td data-testid="overlap">skip</td>' in berlin
    # 03:00 in Berlin in January is 02:00 UTC: the page says both, and which is which.
    assert (
        '<time datetime="2030-01-15T02:00:00+00:00" title="2030-01-15 02:00:00 UTC">'
        "2030-01-15 03:00:00 Europe/Berlin</time>"
    ) in berlin
    assert berlin.count("Europe/Berlin</time>") == 5
    nightly = _row(page, "nightly-report")
    assert '<td data-testid="timezone">UTC</td>' in nightly
    assert '<td data-testid="misfire">latest</td>' in nightly
    assert '<td data-testid="overlap">allow</td>' in nightly
    assert nightly.count(" UTC</time>") == 5
    assert "Pause" not in page  # no actions for a read-only visitor


def test_pause_and_resume_by_an_admin_are_audited_with_the_actor(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)
    log_in(client, "carol")

    paused = client.post("/schedules/nightly-report/pause",
                         data={"csrf_token": csrf(client, "/schedules")})
    page = client.get(paused.headers["location"])
    with pgtask_engine.connect() as connection:
        info = get_schedule(connection, "nightly-report")
    resumed = client.post("/schedules/nightly-report/resume",
                          data={"csrf_token": csrf(client, "/schedules")})

    assert paused.status_code == resumed.status_code == 303
    assert paused.headers["location"] == "/schedules?notice=schedule-paused"
    assert "The schedule is paused" in page.text
    assert 'data-action="schedule_action">Resume</button>' in _row(page.text, "nightly-report")
    assert info is not None
    assert info.paused
    with pgtask_engine.connect() as connection:
        after = get_schedule(connection, "nightly-report")
        entries = list_audit(connection, schedule="nightly-report", limit=10)
    assert after is not None
    assert not after.paused
    assert [(e.action, e.actor) for e in entries][:2] == [
        ("schedule.resume", "dashboard:carol"), ("schedule.pause", "dashboard:carol"),
    ]


def test_schedule_actions_are_refused_without_the_admin_and_write_nothing(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    read_only, admin = client_for(), client_for(admin_token=TOKEN)
    log_in(admin)
    before = snapshot(pgtask_engine)

    anonymous = read_only.post("/schedules/nightly-report/pause",
                               data={"csrf_token": csrf(read_only)})
    no_csrf = admin.post("/schedules/nightly-report/pause", data={})
    unknown = admin.post("/schedules/no-such/pause", data={"csrf_token": csrf(admin)})
    bad_action = admin.post("/schedules/nightly-report/explode",
                            data={"csrf_token": csrf(admin)})
    get = admin.get("/schedules/nightly-report/pause")

    assert anonymous.status_code == 403
    assert "needs the admin token" in anonymous.text
    assert no_csrf.status_code == 403
    assert unknown.status_code == 404
    assert "no schedule named" in unknown.text
    assert bad_action.status_code == 404
    assert get.status_code == 405
    assert snapshot(pgtask_engine) == before
    with pgtask_engine.connect() as connection:
        info = get_schedule(connection, "nightly-report")
        entries = list_audit(connection, schedule="nightly-report", limit=10)
    assert info is not None
    assert not info.paused
    assert [e.action for e in entries] == ["schedule.set"]


def test_run_now_by_an_admin_enqueues_one_occurrence_and_audits_it(
    client_for: Callable[..., TestClient], pgtask_engine: Engine, seeded: Seeded
) -> None:
    client = client_for(admin_token=TOKEN)
    log_in(client, "carol")
    page = client.get("/schedules").text
    assert 'action="/schedules/nightly-report/run-now"' in page

    answer = client.post("/schedules/nightly-report/run-now",
                         data={"csrf_token": csrf(client, "/schedules")})

    assert answer.status_code == 303
    assert answer.headers["location"] == "/schedules?notice=schedule-run"
    assert "One occurrence was enqueued now" in client.get(answer.headers["location"]).text
    with pgtask_engine.connect() as connection:
        [task] = connection.execute(
            select(Task.id, Task.name, Task.queue).where(Task.schedule_name == "nightly-report")
        ).all()
        [entry] = list_audit(connection, schedule="nightly-report", limit=1)
    assert (task.name, task.queue) == ("reports.build", "reports")
    assert (entry.action, entry.actor, entry.task_id) == (
        "schedule.run_now", "dashboard:carol", task.id,
    )


def test_run_now_on_a_role_that_may_not_enqueue_is_a_403_with_the_reason(
    pgtask_database_url: str, pgtask_engine: Engine, seeded: Seeded
) -> None:
    """The admin level of `pgtask grants` cannot insert tasks (docs/roles.md)."""
    before = snapshot(pgtask_engine)
    with login_roles(pgtask_database_url) as roles, \
            role_engine(pgtask_database_url, roles.admin) as admin, \
            TestClient(create_app(admin, admin_token=TOKEN), follow_redirects=False) as client:
        log_in(client, "carol")
        page = client.get("/schedules").text
        answer = client.post("/schedules/nightly-report/run-now",
                             data={"csrf_token": csrf(client, "/schedules")})
        paused = client.post("/schedules/nightly-report/pause",
                             data={"csrf_token": csrf(client, "/schedules")})

    assert 'data-testid="no-run-now"' in page
    assert "/run-now" not in page
    assert answer.status_code == 403
    assert "may not insert into pgtask.tasks" in answer.text
    assert paused.status_code == 303  # the admin level may pause
    with pgtask_engine.connect() as connection:
        entries = list_audit(connection, schedule="nightly-report", limit=10)
    assert [e.action for e in entries] == ["schedule.pause", "schedule.set"]
    assert snapshot(pgtask_engine)[1] == before[1]  # no task was added


def test_an_action_on_a_read_only_role_is_a_403_that_names_the_missing_privilege(
    pgtask_database_url: str, pgtask_engine: Engine, seeded: Seeded
) -> None:
    """A dashboard given the observer level and a token: its actions are refused by the
    database, and the operator is told why rather than shown a server error."""
    before = snapshot(pgtask_engine)
    with login_roles(pgtask_database_url) as roles, \
            role_engine(pgtask_database_url, roles.observer) as observer, \
            TestClient(create_app(observer, admin_token=TOKEN), follow_redirects=False) as client:
        log_in(client, "carol")
        paused = client.post("/schedules/nightly-report/pause",
                             data={"csrf_token": csrf(client, "/schedules")})
        retried = client.post(f"/tasks/{seeded.failed}/retry", data={"csrf_token": csrf(client)})

    assert paused.status_code == retried.status_code == 403
    assert "lacks a privilege this action needs" in paused.text
    assert "lacks a privilege this action needs" in retried.text
    assert snapshot(pgtask_engine) == before
