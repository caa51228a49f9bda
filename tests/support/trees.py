"""trees: deep chains and wide trees of tasks below a given task, inserted in one statement.

Built with SQL (one ``INSERT ... SELECT``), not one enqueue per task: the cascade tests need
thousands of descendants and only their shape (``parent_id``, ``has_children``) matters.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Connection, text

__all__ = ["add_chain", "add_tree", "states_below"]


def add_chain(conn: Connection, head: uuid.UUID, length: int) -> list[uuid.UUID]:
    """A chain of ``length`` pending tasks below ``head`` (each the only child of the one
    above); returns their ids, nearest first."""
    seed = uuid.uuid4().hex
    conn.execute(
        text(
            "INSERT INTO pgtask.tasks (id, queue, name, payload, parent_id, has_children)"
            " SELECT md5(:seed || i)::uuid, 'default', 'link', '{}'::jsonb,"
            "   CASE WHEN i = 1 THEN :head ELSE md5(:seed || (i - 1))::uuid END, i < :n"
            " FROM generate_series(1, :n) AS i"
        ),
        {"seed": seed, "head": head, "n": length},
    )
    conn.execute(
        text("UPDATE pgtask.tasks SET has_children = true WHERE id = :head"), {"head": head}
    )
    return [
        uuid.UUID(str(row[0]))
        for row in conn.execute(
            text("SELECT md5(:seed || i)::uuid FROM generate_series(1, :n) AS i"),
            {"seed": seed, "n": length},
        )
    ]


def add_tree(conn: Connection, head: uuid.UUID, size: int, fanout: int = 10) -> None:
    """``size`` pending tasks below ``head`` in a complete ``fanout``-ary tree (task ``i``'s
    parent is task ``(i - 1) // fanout``, task 0 being ``head``)."""
    seed = uuid.uuid4().hex
    conn.execute(
        text(
            "INSERT INTO pgtask.tasks (id, queue, name, payload, parent_id, has_children)"
            " SELECT md5(:seed || i)::uuid, 'default', 'leaf', '{}'::jsonb,"
            "   CASE WHEN i <= :f THEN :head ELSE md5(:seed || ((i - 1) / :f))::uuid END,"
            "   i * :f + 1 <= :n"
            " FROM generate_series(1, :n) AS i"
        ),
        {"seed": seed, "head": head, "n": size, "f": fanout},
    )
    conn.execute(
        text("UPDATE pgtask.tasks SET has_children = true WHERE id = :head"), {"head": head}
    )


def states_below(conn: Connection, head: uuid.UUID) -> dict[str, int]:
    """How many descendants of ``head`` are in each state."""
    rows = conn.execute(
        text(
            # A lateral probe per task (OFFSET 0): a plain recursive join may be planned as a
            # scan of the whole table per level, n^2 on a deep chain.
            "WITH RECURSIVE below AS ("
            "  SELECT id, state FROM pgtask.tasks WHERE parent_id = :head"
            "  UNION ALL SELECT c.id, c.state FROM below CROSS JOIN LATERAL ("
            "    SELECT t.id, t.state FROM pgtask.tasks AS t WHERE t.parent_id = below.id"
            "    OFFSET 0) AS c)"
            " SELECT state, count(*) FROM below GROUP BY state"
        ),
        {"head": head},
    )
    return {str(state): int(count) for state, count in rows}
