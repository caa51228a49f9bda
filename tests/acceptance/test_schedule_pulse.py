"""A one-second schedule under four real worker processes creates a task for every second,
from its first occurrence on (docs/schedules.md, "Late occurrences"; failure model,
"Scheduler failures").

Occurrences are database time; the test never compares them with its own clock, it waits
for the occurrence a minute after the first one to have its task and then counts.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from sqlalchemy_pgtask.schedule import set_schedule
from tests.support.waiting import PATIENCE, wait_until
from tests.support.workerproc import Database, WorkerLauncher, describe_all

WORKERS = 4
MINUTE = 60


def test_a_one_second_schedule_under_four_workers_creates_a_task_every_second(
    db: Database, workers: WorkerLauncher
) -> None:
    # The default misfire policy ("latest") collapsed any backlog into one task: a first
    # pass more than a second late (nothing woke the workers) or one delayed pass lost
    # occurrences (8 in 10.8 s on a quiet machine). A delay within the grace loses none.
    # Started together, so their maintenance passes run together at first and then rest
    # for their interval: the schedule created meanwhile wakes them, or waits for them.
    started = [workers.start(concurrency=4, wait_ready=False) for _ in range(WORKERS)]
    for worker in started:
        workers.wait_ready(worker)
    everyone = describe_all(started)
    with Session(db.engine) as session:
        info = set_schedule(session, "pulse", task="job", every=1)
        session.commit()
    first = info.next_run_at
    last = first + timedelta(seconds=MINUTE)

    def newest() -> object:
        return db.scalar(
            "SELECT max(scheduled_for) >= :last FROM pgtask.tasks WHERE schedule_name = 'pulse'",
            last=last,
        )

    wait_until(newest, MINUTE + PATIENCE, interval=0.5,
               message="the occurrence a minute after the first to have its task",
               describe=everyone)
    found = [row.scheduled_for for row in db.rows(
        "SELECT scheduled_for FROM pgtask.tasks WHERE schedule_name = 'pulse'"
        " AND scheduled_for <= :last ORDER BY scheduled_for", last=last,
    )]
    expected = [first + timedelta(seconds=k) for k in range(MINUTE + 1)]
    assert set(found) <= set(expected)
    missing = sorted(set(expected) - set(found))
    assert len(missing) <= 1, (missing, everyone())
