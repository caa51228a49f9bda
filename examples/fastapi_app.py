"""A FastAPI application: enqueue in the request's transaction, report a task's status, and
mount the dashboard behind the application's own auth.

Install the schema once, then run the app and a worker, from this directory::

    export PGTASK_DATABASE_URL=postgresql://app@127.0.0.1/app
    pgtask migrate
    uvicorn --factory fastapi_app:create_application      # the web application
    pgtask worker fastapi_app:registry                     # in another shell

    curl -X POST localhost:8000/signups -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com"}'                 # {"signup_id": 1, "task_id": "..."}
    curl 'localhost:8000/tasks/<task_id>?timeout=10'       # waits up to 10 s for the result
    curl -H 'x-user: alice' localhost:8000/pgtask/         # the dashboard, as operator alice

The signup row and its welcome task commit together (or not at all): a request that fails
after the enqueue leaves neither behind. The application talks to the database through an
`AsyncSession` on ``create_async_engine`` with psycopg; the dashboard, whose pages run in a
thread pool, gets a synchronous engine of its own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from sqlalchemy import String, create_engine, make_url
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqlalchemy_pgtask import (
    Registry,
    TaskContext,
    TaskNotFound,
    get_task_async,
    wait_for_result_async,
)
from sqlalchemy_pgtask.dashboard import create_app as create_dashboard

registry = Registry()

#: Who may act in the dashboard (retry, cancel, pause). Everyone else who is signed in may
#: only look. A stand-in for your real user store and roles.
OPERATORS = frozenset({"alice"})

#: The longest a status request may wait for a result, in seconds.
MAX_WAIT = 30.0


class Base(DeclarativeBase):
    pass


class Signup(Base):
    __tablename__ = "signups"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(254))


@registry.task("send-welcome", queue="emails")
async def send_welcome(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Sends the welcome mail (a stand-in that only says whom it would have written to)."""
    return {"sent_to": payload["email"], "signup_id": payload["signup_id"]}


class SignupIn(BaseModel):
    email: str = Field(min_length=3, max_length=254, pattern=r"^[^@\s]+@[^@\s]+$")


class SignupOut(BaseModel):
    signup_id: int
    task_id: uuid.UUID


class TaskStatus(BaseModel):
    id: uuid.UUID
    name: str
    state: str
    attempt: int
    result: Any = None
    error: dict[str, Any] | None = None


def _psycopg(url: str | URL) -> URL:
    # The URL an operator writes (postgresql://...) names no driver; both engines use psycopg 3.
    return make_url(url).set(drivername="postgresql+psycopg")


def signed_in_user(request: Request) -> str | None:
    """The user the request is signed in as: here an ``X-User`` header, a stand-in for your
    real authentication (a session cookie, an OAuth token, ...)."""
    user = request.headers.get("x-user", "").strip()
    return user or None


def operator(request: Request) -> str | None:
    """The dashboard's ``actor_from_request`` hook: the actor its audit log records for an
    operator's action, or None, which lets the request look but not act."""
    user = signed_in_user(request)
    return f"app:{user}" if user in OPERATORS else None


async def open_session(request: Request) -> AsyncIterator[AsyncSession]:
    """A session for one request; the endpoint decides where its transaction begins and ends."""
    engine: AsyncEngine = request.app.state.engine
    async with AsyncSession(engine, expire_on_commit=False) as session:
        yield session


DbSession = Annotated[AsyncSession, Depends(open_session)]


def create_application(database_url: str | URL | None = None) -> FastAPI:
    """The application on ``database_url`` (default ``$PGTASK_DATABASE_URL``), whose pgtask
    schema is installed (``pgtask migrate``)."""
    url = _psycopg(database_url or os.environ["PGTASK_DATABASE_URL"])
    engine: AsyncEngine = create_async_engine(url)
    # A mounted application's lifespan never runs, so the dashboard gets an engine that this
    # application opens and closes, rather than a URL it would open a pool for itself.
    dashboard_engine = create_engine(url, pool_size=2, max_overflow=2)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The example creates its own table; a real application's Alembic migrations would.
        async with engine.begin() as connection:
            await connection.run_sync(Base.metadata.create_all)
        yield
        await engine.dispose()
        dashboard_engine.dispose()

    app = FastAPI(title="signups", lifespan=lifespan)
    app.state.engine = engine

    @app.post("/signups", status_code=201)
    async def create_signup(body: SignupIn, db: DbSession) -> SignupOut:
        # One transaction: the row and the task commit together before the response is sent.
        async with db.begin():
            signup = Signup(email=body.email)
            db.add(signup)
            await db.flush()  # assigns signup.id, which the payload and the key need
            task = await send_welcome.enqueue_async(
                db,
                {"signup_id": signup.id, "email": signup.email},
                idempotency_key=f"welcome-{signup.id}",
            )
        return SignupOut(signup_id=signup.id, task_id=task.id)

    @app.get("/tasks/{task_id}")
    async def task_status(
        task_id: uuid.UUID,
        db: DbSession,
        timeout: Annotated[float, Query(ge=0, le=MAX_WAIT)] = 0,
    ) -> TaskStatus:
        """The task's state now; with ``timeout``, first wait up to that many seconds for
        it to finish (a task still unfinished then is reported as it is, not as an error)."""
        if timeout > 0:
            # The wait holds one of the engine's connections (it LISTENs for the task's end,
            # then closes it) for up to MAX_WAIT seconds: size the pool for the waits allowed.
            try:
                await wait_for_result_async(engine, task_id, timeout=timeout)
            except TimeoutError:
                pass
            except TaskNotFound:
                raise HTTPException(404, f"no task {task_id}") from None
        task = await get_task_async(db, task_id)
        if task is None:
            raise HTTPException(404, f"no task {task_id}")
        return TaskStatus(
            id=task.id, name=task.name, state=task.state, attempt=task.attempt,
            result=task.result, error=task.error,
        )

    @app.middleware("http")
    async def require_sign_in(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        # The dashboard shows payloads and results: only signed-in users may see it at all.
        # This runs before the mounted dashboard, so a request refused here never reaches it.
        path = request.url.path
        dashboard = path == "/pgtask" or path.startswith("/pgtask/")
        if dashboard and signed_in_user(request) is None:
            return JSONResponse({"detail": "sign in first"}, status_code=401)
        return await call_next(request)

    app.mount("/pgtask", create_dashboard(dashboard_engine, actor_from_request=operator))
    return app
