"""catalog: schema pgtask as PostgreSQL's catalog reports it, to compare schemas; reads only.

`catalog_snapshot` lists one fact per line (relations, columns, constraints, indexes), sorted,
so two databases' schemas compare with ``==`` and differ in a readable diff.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, text

__all__ = ["catalog_snapshot"]

# One catalog fact per row, for every object of schema pgtask except the standalone
# migrator's version table (which create_all never makes).
_RELATIONS = text("""
    SELECT c.relname, c.relkind::text, c.relpersistence::text,
           coalesce((SELECT array_agg(o ORDER BY o) FROM unnest(c.reloptions) AS o), '{}'),
           obj_description(c.oid, 'pg_class')
    FROM pg_class AS c
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = 'pgtask'
      AND c.relname NOT IN ('alembic_version', 'alembic_version_pkc')
""")
_COLUMNS = text("""
    SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
           pg_get_expr(d.adbin, d.adrelid), a.attidentity::text, a.attgenerated::text,
           coll.collname, col_description(c.oid, a.attnum)
    FROM pg_attribute AS a
    JOIN pg_class AS c ON c.oid = a.attrelid
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    LEFT JOIN pg_collation AS coll
        ON coll.oid = a.attcollation AND a.attcollation <> (
            SELECT t.typcollation FROM pg_type AS t WHERE t.oid = a.atttypid)
    WHERE n.nspname = 'pgtask' AND c.relkind IN ('r', 'p') AND a.attnum > 0
      AND NOT a.attisdropped AND c.relname <> 'alembic_version'
""")
_CONSTRAINTS = text("""
    SELECT c.relname, con.conname, con.contype::text, pg_get_constraintdef(con.oid)
    FROM pg_constraint AS con
    JOIN pg_class AS c ON c.oid = con.conrelid
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = 'pgtask' AND c.relname <> 'alembic_version'
      -- A constraint trigger is a trigger, which the models do not create: the revisions'
      -- triggers are checked against their docstrings instead.
      AND con.contype <> 't'
""")
_INDEXES = text("""
    SELECT t.relname, i.relname, pg_get_indexdef(x.indexrelid)
    FROM pg_index AS x
    JOIN pg_class AS i ON i.oid = x.indexrelid
    JOIN pg_class AS t ON t.oid = x.indrelid
    JOIN pg_namespace AS n ON n.oid = t.relnamespace
    WHERE n.nspname = 'pgtask' AND t.relname <> 'alembic_version'
""")


def catalog_snapshot(engine: Engine) -> list[str]:
    """Schema pgtask as sorted, readable lines: relations, columns, constraints, indexes."""
    with engine.connect() as connection:
        return _lines(connection)


def _lines(connection: Connection) -> list[str]:
    lines: list[str] = []
    for name, kind, persistence, options, comment in connection.execute(_RELATIONS):
        lines.append(
            f"relation {name}: kind={kind} persistence={persistence} options={options}"
            f" comment={comment!r}"
        )
    for table, column, type_, not_null, default, identity, generated, collation, comment in (
        connection.execute(_COLUMNS)
    ):
        facts = [type_, "NOT NULL" if not_null else "NULL"]
        facts += [f"DEFAULT {default}"] if default is not None else []
        facts += [f"identity={identity}"] if identity else []
        facts += [f"generated={generated}"] if generated else []
        facts += [f"COLLATE {collation}"] if collation is not None else []
        facts += [f"comment={comment!r}"] if comment is not None else []
        lines.append(f"column {table}.{column}: {' '.join(facts)}")
    for table, name, kind, definition in connection.execute(_CONSTRAINTS):
        lines.append(f"constraint {table}.{name} [{kind}]: {definition}")
    for table, name, definition in connection.execute(_INDEXES):
        lines.append(f"index {table}.{name}: {definition}")
    return sorted(lines)
