"""SQLModel: enqueue with its ``Session`` and its ``AsyncSession``, in the same transaction as
the rows you add, then run a worker until the tasks are done.

    PGTASK_DATABASE_URL=postgresql://app@127.0.0.1/app python examples/sqlmodel_app.py

A SQLModel session is a SQLAlchemy session, so ``enqueue`` and ``enqueue_async`` take it as
they are: the note and its task commit together, and a transaction rolled back after the
enqueue leaves neither. With ``PGTASK_DATABASE_URL`` the script installs (or upgrades) the
pgtask schema there and adds a ``notes`` table; without it, it starts a throwaway PostgreSQL
and a database it drops at the end, as ``pgtask demo`` does. The worker runs in this process
(``drain``); a deployment runs ``pgtask worker sqlmodel_app:registry`` instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from typing import Any

from sqlalchemy import func, make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import Field, Session, SQLModel, col, create_engine, select
from sqlmodel.ext.asyncio.session import AsyncSession

from sqlalchemy_pgtask import Registry, SyncTaskContext, get_task, get_task_async
from sqlalchemy_pgtask.migrations import upgrade
from sqlalchemy_pgtask.testing import create_database, drain, drop_database, provide_server

registry = Registry()


class Note(SQLModel, table=True):
    __tablename__ = "notes"

    id: int | None = Field(default=None, primary_key=True)
    text: str = Field(max_length=200)
    words: int | None = None


@registry.task("count-words", queue="notes")
def count_words(ctx: SyncTaskContext, payload: dict[str, int]) -> dict[str, int]:
    """Counts a note's words and stores the count on the note, exactly once (a fenced
    transaction: it writes only while the worker holds the task's lease)."""
    step = ctx.transaction("store-count")
    with step as session:
        note = session.get(Note, payload["note_id"])
        assert note is not None
        note.words = len(note.text.split())
        step.result = note.words
    return {"note_id": payload["note_id"], "words": step.result}


def add_note(session: Session, text: str) -> tuple[int, uuid.UUID]:
    """The note and its task, in ``session``'s transaction: the caller commits both."""
    note = Note(text=text)
    session.add(note)
    session.flush()  # assigns note.id
    assert note.id is not None
    task = count_words.enqueue(session, {"note_id": note.id}, idempotency_key=f"note-{note.id}")
    return note.id, task.id


async def add_note_async(session: AsyncSession, text: str) -> tuple[int, uuid.UUID]:
    """`add_note` with an `AsyncSession`."""
    note = Note(text=text)
    session.add(note)
    await session.flush()
    assert note.id is not None
    task = await count_words.enqueue_async(
        session, {"note_id": note.id}, idempotency_key=f"note-{note.id}"
    )
    return note.id, task.id


async def enqueue_with_async_session(url: str) -> list[uuid.UUID]:
    """One note committed with its task, one rolled back with its task."""
    engine = create_async_engine(url)
    try:
        async with AsyncSession(engine) as session:
            async with session.begin():
                _, kept = await add_note_async(session, "written with an AsyncSession")
            _, dropped = await add_note_async(session, "never committed")
            await session.rollback()  # the note and its task go back together
            assert await get_task_async(session, dropped) is None
        return [kept]
    finally:
        await engine.dispose()


def run(url: str) -> dict[str, Any]:
    """Enqueue with both sessions, work, read back: each task's state and each note."""
    upgrade(url)
    engine = create_engine(url)
    try:
        SQLModel.metadata.create_all(engine)
        with Session(engine) as session, session.begin():
            _, task_id = add_note(session, "two sessions, one transaction each")
        print(f"task {task_id} enqueued with a Session")
        [async_task_id] = asyncio.run(enqueue_with_async_session(url))
        print(f"task {async_task_id} enqueued with an AsyncSession; a rolled-back one is gone")

        asyncio.run(drain(registry, url))  # a real worker, in this process, until idle

        with Session(engine) as session:
            states = {}
            for done in (task_id, async_task_id):
                task = get_task(session, done)
                assert task is not None
                states[str(done)] = task.state
                print(f"task {task.state}: {task.result}")
            notes = session.exec(select(Note).order_by(col(Note.id))).all()
            for note in notes:
                print(f"note {note.id}: {note.words} words")
            count = session.exec(select(func.count()).select_from(Note)).one()
        return {"states": states, "words": [n.words for n in notes], "notes": count}
    finally:
        engine.dispose()


def main() -> int:
    logging.getLogger("sqlalchemy_pgtask").setLevel(logging.WARNING)
    given = os.environ.get("PGTASK_DATABASE_URL")
    if given:
        # The package talks to PostgreSQL through psycopg 3, whatever driver the URL names.
        url = make_url(given).set(drivername="postgresql+psycopg")
        outcome = run(url.render_as_string(hide_password=False))
    else:
        with provide_server(
            url_env="PGTASK_DATABASE_URL", backend_env="PGTASK_DEMO_BACKEND", allow_docker=False
        ) as server:
            throwaway = create_database(server.url, "pgtask_sqlmodel_example")
            try:
                outcome = run(throwaway)
            finally:
                drop_database(throwaway)
    ok = set(outcome["states"].values()) == {"succeeded"} and outcome["notes"] == 2
    print("example finished" if ok else "example FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
