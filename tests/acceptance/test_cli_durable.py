"""``pgtask task show`` of durable tasks: the Wait and Parent lines, the Children and Steps
sections, and the same in the ``--json`` document.

A real worker (in this process) puts a workflow into its waits and a task to sleep; the command
then runs as the operator runs it, a subprocess on the same database.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from sqlalchemy_pgtask import (
    Checkpoint,
    Registry,
    Task,
    TaskContext,
    Wait,
    WorkerOptions,
    emit_signal_async,
)
from sqlalchemy_pgtask.cli._render import task_detail_lines, when
from sqlalchemy_pgtask.status import TaskDetail, WaitInfo
from sqlalchemy_pgtask.testing import running_worker, wait_until
from tests.support.tasks import add, attempt_rows, wait_for_state
from tests.support.waiting import PATIENCE
from tests.support.workerproc import lines, run_cli

OPTIONS = WorkerOptions(lease_duration=5.0, shutdown_grace=2.0, poll_interval=0.5)
BIG = "x" * 300


def workflow_registry() -> Registry:
    registry = Registry()

    @registry.task("ship")
    async def ship(ctx: TaskContext, payload: dict[str, int]) -> Any:
        label = await ctx.step("label", lambda: {"label": f"L-{payload['order']}"})
        await ctx.wait_for_signal("await-go", "go", timeout=3600)
        return label

    @registry.task("order", max_attempts=1)
    async def order(ctx: TaskContext, payload: None) -> Any:
        await ctx.step("charge", lambda: {"ref": "ch_1"})
        child = await ctx.spawn("spawn-ship", ship, {"order": 7})
        return (await ctx.wait_for_result("await-ship", child)).result

    @registry.task("sleeper", max_attempts=1)
    async def sleeper(ctx: TaskContext, payload: None) -> None:
        await ctx.step("big", lambda: BIG)
        await ctx.sleep_for("nap", 3600)

    return registry


@dataclass(frozen=True)
class Workflow:
    """An order waiting for its shipment, which waits for a signal; a sleeper asleep."""

    order: uuid.UUID
    ship: uuid.UUID
    sleeper: uuid.UUID


async def start_workflow(url: str, engine: AsyncEngine) -> Workflow:
    order = await add(engine, "order")
    sleeper = await add(engine, "sleeper")
    async with running_worker(workflow_registry(), url, OPTIONS):
        await wait_for_state(engine, order, ["waiting"], timeout=PATIENCE)

        async def asleep() -> bool:
            rows = await attempt_rows(engine, sleeper)
            return bool(rows) and rows[-1]["state"] == "suspended"

        await wait_until(asleep, PATIENCE, message="the sleeper to suspend")
        async with engine.connect() as conn:
            ship = (await conn.execute(
                select(Task.id).where(Task.parent_id == order)
            )).scalar_one()
        await wait_for_state(engine, ship, ["waiting"], timeout=PATIENCE)
    return Workflow(order, ship, sleeper)


async def show(app_dir: Path, url: str, task_id: uuid.UUID, *options: str) -> str:
    result = await asyncio.to_thread(
        run_cli, "task", "show", str(task_id), *options, "--database-url", url, cwd=app_dir
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def fields(output: str) -> dict[str, str]:
    """``name: value`` lines at the task's own indentation."""
    return {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in output.splitlines())
        if key.startswith("  ") and not key.startswith("   ")
    }


def section(output: str, name: str) -> list[str]:
    """The lines of a top-level section (``steps:``), up to the next one."""
    out = output.splitlines()
    start = out.index(f"{name}:") + 1
    end = next((i for i in range(start, len(out)) if not out[i].startswith(" ")), len(out))
    return out[start:end]


def checkpoint_times(engine: Engine, task_id: uuid.UUID) -> dict[str, datetime]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(Checkpoint.step, Checkpoint.created_at).where(Checkpoint.task_id == task_id)
        )
        return {row.step: row.created_at for row in rows}


def wait_row(engine: Engine, task_id: uuid.UUID) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(Wait).where(Wait.task_id == task_id)).one()


async def test_task_show_prints_the_wait_the_parent_the_children_and_the_steps(
    app_dir: Path,
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
) -> None:
    flow = await start_workflow(pgtask_database_url, pgtask_async_engine)

    shown = await show(app_dir, pgtask_database_url, flow.order)
    out = shown.splitlines()
    waits = wait_row(pgtask_engine, flow.order)
    times = checkpoint_times(pgtask_engine, flow.order)
    assert fields(shown)["wait"] == (
        f"child {flow.ship} (step 'await-ship' #0), since {when(waits.created_at)}, no timeout"
    )
    assert fields(shown)["parent"] == "-"
    assert section(shown, "children") == [f"  {flow.ship}  ship v1  waiting"]
    assert section(shown, "steps") == [
        f"""  'charge' #0: step at {when(times["charge"])}: {{"ref": "ch_1"}}""",
        f"""  'spawn-ship' #0: spawn at {when(times["spawn-ship"])}: """
        f"""{{"task_id": "{flow.ship}"}}""",
    ]
    # The task's own fields and documents first, its relations next, its attempts last.
    assert out.index("children:") < out.index("steps:") < out.index("attempts:")
    assert out[-1].startswith("  attempt 1: suspended by worker ")

    shown = await show(app_dir, pgtask_database_url, flow.ship)
    waits = wait_row(pgtask_engine, flow.ship)
    assert fields(shown)["parent"] == f"{flow.order}  order v1  waiting"
    assert fields(shown)["wait"] == (
        f"signal go #0 (step 'await-go' #0), since {when(waits.created_at)}, "
        f"times out {when(waits.timeout_at)}"
    )
    assert "children:" not in shown.splitlines()
    assert [line.split(": ", 1)[0] for line in section(shown, "steps")] == ["  'label' #0"]

    shown = await show(app_dir, pgtask_database_url, flow.sleeper)
    times = checkpoint_times(pgtask_engine, flow.sleeper)
    assert fields(shown)["state"] == "pending"
    assert fields(shown)["wait"] == (
        f"sleep (step 'nap' #0), since {when(times['nap'])}, wakes {fields(shown)['run_at']}"
    )
    big, nap = section(shown, "steps")
    # A long value is cut in the text; --json has it all.
    assert big == (
        f"""  'big' #0: step at {when(times["big"])}: "{BIG[:119]}... """
        f"""({len(BIG) + 2} characters; --json has all)"""
    )
    assert nap.startswith(f"""  'nap' #0: sleep at {when(times["nap"])}: {{"wake_at": "20""")


async def test_task_show_of_a_task_without_durable_calls_has_no_such_sections(
    app_dir: Path, pgtask_database_url: str, pgtask_async_engine: AsyncEngine
) -> None:
    task_id = await add(pgtask_async_engine, "job")

    shown = await show(app_dir, pgtask_database_url, task_id)
    out = shown.splitlines()
    assert (fields(shown)["wait"], fields(shown)["parent"]) == ("-", "-")
    assert "steps:" not in out
    assert "children:" not in out
    assert out[-1] == "attempts: none"

    document = json.loads(await show(app_dir, pgtask_database_url, task_id, "--json"))
    assert (document["steps"], document["wait"], document["children"], document["parent"]) == (
        [], None, [], None,
    )


async def test_task_show_json_has_the_steps_the_wait_the_children_and_the_parent(
    app_dir: Path,
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
) -> None:
    flow = await start_workflow(pgtask_database_url, pgtask_async_engine)

    shown = await show(app_dir, pgtask_database_url, flow.order, "--json")
    assert len(lines(shown)) == 1
    document = json.loads(shown)
    for relation in ("steps", "wait", "children", "parent"):
        assert relation not in document["task"]
    waits = wait_row(pgtask_engine, flow.order)
    assert datetime.fromisoformat(document["wait"].pop("since")) == waits.created_at
    assert document["wait"] == {
        "kind": "child", "step": "await-ship", "occurrence": 0, "deadline": None,
        "signal_name": None, "signal_occurrence": None, "child_id": str(flow.ship),
    }
    assert document["children"] == [
        {"id": str(flow.ship), "name": "ship", "version": 1, "state": "waiting"}
    ]
    assert (document["parent"], document["task"]["parent_id"]) == (None, None)
    steps = document["steps"]
    for step in steps:
        assert datetime.fromisoformat(step.pop("created_at")).utcoffset() is not None
    assert steps == [
        {"step": "charge", "occurrence": 0, "version": 1, "kind": "step",
         "value": {"ref": "ch_1"}},
        {"step": "spawn-ship", "occurrence": 0, "version": 1, "kind": "spawn",
         "value": {"task_id": str(flow.ship)}},
    ]

    document = json.loads(await show(app_dir, pgtask_database_url, flow.ship, "--json"))
    waits = wait_row(pgtask_engine, flow.ship)
    assert document["parent"] == {
        "id": str(flow.order), "name": "order", "version": 1, "state": "waiting"
    }
    assert document["task"]["parent_id"] == str(flow.order)
    assert (document["wait"]["kind"], document["wait"]["signal_name"]) == ("signal", "go")
    assert datetime.fromisoformat(document["wait"]["deadline"]) == waits.timeout_at

    document = json.loads(await show(app_dir, pgtask_database_url, flow.sleeper, "--json"))
    run_at = datetime.fromisoformat(document["task"]["run_at"])
    assert (document["wait"]["kind"], document["wait"]["step"]) == ("sleep", "nap")
    assert datetime.fromisoformat(document["wait"]["deadline"]) == run_at
    assert document["steps"][0]["value"] == BIG


async def test_task_show_of_a_finished_workflow_lists_its_ended_children_and_no_wait(
    app_dir: Path,
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
) -> None:
    flow = await start_workflow(pgtask_database_url, pgtask_async_engine)
    async with pgtask_async_engine.begin() as conn:
        await emit_signal_async(conn, flow.ship, "go")
    async with running_worker(workflow_registry(), pgtask_database_url, OPTIONS):
        row = await wait_for_state(pgtask_async_engine, flow.order, timeout=PATIENCE)
    assert row["state"] == "succeeded"

    shown = await show(app_dir, pgtask_database_url, flow.order)
    times = checkpoint_times(pgtask_engine, flow.order)
    assert fields(shown)["wait"] == "-"
    assert section(shown, "children") == [f"  {flow.ship}  ship v1  succeeded"]
    # Oldest first; the child's result was stored when the child ended.
    assert [line.split(": ", 2)[:2] for line in section(shown, "steps")] == [
        ["  'charge' #0", f"step at {when(times['charge'])}"],
        ["  'spawn-ship' #0", f"spawn at {when(times['spawn-ship'])}"],
        ["  'await-ship' #0", f"result at {when(times['await-ship'])}"],
    ]
    assert section(shown, "steps")[-1].endswith(
        """: {"error": null, "result": {"label": "L-7"}, "state": "succeeded"}"""
    )
    shown = await show(app_dir, pgtask_database_url, flow.ship)
    assert fields(shown)["parent"] == f"{flow.order}  order v1  succeeded"


async def test_task_show_marks_a_step_of_another_handler_version(
    app_dir: Path,
    pgtask_database_url: str,
    pgtask_engine: Engine,
    pgtask_async_engine: AsyncEngine,
) -> None:
    task_id = await add(pgtask_async_engine, "job", version=2)
    with pgtask_engine.begin() as conn:
        for version in (1, 2):
            conn.execute(
                insert(Checkpoint).values(
                    task_id=task_id, version=version, step="charge", occurrence=0, kind="step",
                    value={"v": version},
                )
            )

    steps = section(await show(app_dir, pgtask_database_url, task_id), "steps")
    # Two checkpoints of one name must not look like one: the older version's says so.
    assert sorted(line.split(" at ", 1)[0] for line in steps) == [
        "  'charge' #0 (v1): step", "  'charge' #0: step",
    ]


def test_a_parent_gone_between_two_reads_still_shows_its_id() -> None:
    # Only a READ COMMITTED caller of status.task_detail can see it (the command reads one
    # snapshot): the task row still names its parent, whose row was deleted since.
    now = datetime.now(timezone.utc)
    parent_id = uuid.uuid4()
    task = TaskDetail(
        id=uuid.uuid4(), queue="default", name="ship", version=1, state="waiting", priority=0,
        attempt=1, max_attempts=5, run_at=now, created_at=now, updated_at=now,
        completed_at=None, failed_attempts=0, payload=None, headers={}, result=None,
        error=None, idempotency_key=None, parent_id=parent_id, lease_owner=None,
        lease_expires_at=None, cancel_requested_at=None, retry_kind=None,
        retry_base_seconds=None, retry_factor=None, retry_max_seconds=None, retry_jitter=None,
        attempts=(),
        wait=WaitInfo(
            kind="signal", step="s", occurrence=1, since=now, deadline=None, signal_name="go",
            signal_occurrence=3,
        ),
    )
    shown = fields("\n".join(task_detail_lines(task)))
    assert shown["parent"] == str(parent_id)
    assert shown["wait"] == f"signal go #3 (step 's' #1), since {when(now)}, no timeout"
