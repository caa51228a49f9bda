"""statements: SQLAlchemy Core builders for every write to the pgtask tables; performs no I/O.

Each statement is built once at import and executed with plain parameter dictionaries, so
SQLAlchemy's compiled cache serves every later call. Each docstring says which rows the
statement locks, which index serves it and what it returns. Deadlines always come from
database time (`NOW`, ``pgtask.now()``), never from the client's clock. Statements that take
more than a few parameters come with a typed builder of exactly those parameters.

By responsibility: `enqueue` (adding tasks), `claim` (claims and the next due time), `lease`
(renewals, outcomes, recovery), `workers` (registration, heartbeats, policies, pruning),
`steps` (checkpoints, sleeps, children), `waits` (signals, child-result waits, their
timeouts), `admin` (cancellation, checks).
"""

from __future__ import annotations

from sqlalchemy_pgtask.statements._common import NOW, Lease
from sqlalchemy_pgtask.statements._fence import DurableParams, durable_params
from sqlalchemy_pgtask.statements.admin import CANCEL, SCHEMA_INSTALLED
from sqlalchemy_pgtask.statements.claim import (
    CLAIM,
    CLAIM_GOVERNED,
    CLAIMED_COLUMNS,
    Capability,
    CapabilityParams,
    ClaimParams,
    capability_params,
    claim_params,
)
from sqlalchemy_pgtask.statements.due import (
    GOVERNED_QUEUES,
    SECONDS_UNTIL_DUE,
    SECONDS_UNTIL_DUE_GOVERNED,
)
from sqlalchemy_pgtask.statements.enqueue import (
    DEFAULT_IDEMPOTENCY_RETENTION_SECONDS,
    ENQUEUE_BATCH,
    ENQUEUE_BATCH_IDEMPOTENT,
    ENQUEUE_ONE,
    ENQUEUE_PLAIN,
    ENQUEUE_UNIFORM,
    TAKE_OVER_KEYS,
    key_expired,
)
from sqlalchemy_pgtask.statements.lease import (
    COMPLETE,
    FAIL,
    LEASES,
    OWNED,
    RECOVER,
    RELEASE,
    RENEW,
    CompleteParams,
    FailParams,
    FenceParams,
    ReleaseParams,
    RenewParams,
    complete_params,
    fail_params,
    fence_params,
    release_params,
    renew_params,
)
from sqlalchemy_pgtask.statements.steps import (
    CHECKPOINT,
    CHECKPOINTS,
    FENCE_STATE,
    SAVE_CHECKPOINT,
    SLEEP,
    SPAWN,
)
from sqlalchemy_pgtask.statements.waits import (
    DUE_WAITS,
    EMIT_SIGNAL,
    LOCK_CHILD,
    LOCK_FOR_WAIT,
    NEXT_WAIT_TIMEOUT,
    REGISTER_RESULT_WAIT,
    REGISTER_SIGNAL_WAIT,
    WAIT_TIMEOUT,
    WAIT_TIMEOUTS,
)
from sqlalchemy_pgtask.statements.workers import (
    ADD_CAPABILITIES,
    CLEAR_CAPABILITIES,
    HEARTBEAT,
    POLICY_COLUMNS,
    PRUNE_WORKERS,
    REGISTER_POLICIES,
    REGISTER_WORKER,
    RETIRE_WORKER,
    STORED_POLICIES,
    HeartbeatParams,
    IdentityParams,
    PolicyParams,
    RegisterParams,
    identity_params,
    policy_params,
)

__all__ = [
    "ADD_CAPABILITIES",
    "CANCEL",
    "CHECKPOINT",
    "CHECKPOINTS",
    "CLAIM",
    "CLAIMED_COLUMNS",
    "CLAIM_GOVERNED",
    "CLEAR_CAPABILITIES",
    "COMPLETE",
    "DEFAULT_IDEMPOTENCY_RETENTION_SECONDS",
    "DUE_WAITS",
    "EMIT_SIGNAL",
    "ENQUEUE_BATCH",
    "ENQUEUE_BATCH_IDEMPOTENT",
    "ENQUEUE_ONE",
    "ENQUEUE_PLAIN",
    "ENQUEUE_UNIFORM",
    "FAIL",
    "FENCE_STATE",
    "GOVERNED_QUEUES",
    "HEARTBEAT",
    "LEASES",
    "LOCK_CHILD",
    "LOCK_FOR_WAIT",
    "NEXT_WAIT_TIMEOUT",
    "NOW",
    "OWNED",
    "POLICY_COLUMNS",
    "PRUNE_WORKERS",
    "RECOVER",
    "REGISTER_POLICIES",
    "REGISTER_RESULT_WAIT",
    "REGISTER_SIGNAL_WAIT",
    "REGISTER_WORKER",
    "RELEASE",
    "RENEW",
    "RETIRE_WORKER",
    "SAVE_CHECKPOINT",
    "SCHEMA_INSTALLED",
    "SECONDS_UNTIL_DUE",
    "SECONDS_UNTIL_DUE_GOVERNED",
    "SLEEP",
    "SPAWN",
    "STORED_POLICIES",
    "TAKE_OVER_KEYS",
    "WAIT_TIMEOUT",
    "WAIT_TIMEOUTS",
    "Capability",
    "CapabilityParams",
    "ClaimParams",
    "CompleteParams",
    "DurableParams",
    "FailParams",
    "FenceParams",
    "HeartbeatParams",
    "IdentityParams",
    "Lease",
    "PolicyParams",
    "RegisterParams",
    "ReleaseParams",
    "RenewParams",
    "capability_params",
    "claim_params",
    "complete_params",
    "durable_params",
    "fail_params",
    "fence_params",
    "identity_params",
    "key_expired",
    "policy_params",
    "release_params",
    "renew_params",
]
