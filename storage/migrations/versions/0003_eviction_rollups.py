"""Per-minute eviction rollups, backfilled from the eviction log.

Revision ID: 0003
Revises: 0002

The bins below are frozen copies of storage.schema' edges at this revision; later edge changes
need their own migration.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

ROLLUP_SECONDS = 60
AGE_EDGES_S = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0)
HIT_EDGES = (1, 2, 3, 5, 10, 20, 50, 100)
AGE_BINS = tuple(f"age_bin_{index}" for index in range(len(AGE_EDGES_S) + 1))
HIT_BINS = tuple(f"hit_bin_{index}" for index in range(len(HIT_EDGES) + 1))


def upgrade() -> None:
    rollups = op.create_table(
        "eviction_rollups",
        sa.Column("run_id", sa.String(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("minute", sa.BigInteger, primary_key=True),
        sa.Column("reason", sa.String(), primary_key=True),
        sa.Column("evictions", sa.Integer, nullable=False),
        *(sa.Column(name, sa.Integer, nullable=False) for name in AGE_BINS + HIT_BINS),
    )
    op.create_index("ix_eviction_rollups_minute", "eviction_rollups", ["minute"])
    op.execute(
        rollups.insert().from_select(["run_id", "minute", "reason", "evictions", *AGE_BINS, *HIT_BINS], _backfill())
    )


def downgrade() -> None:
    op.drop_table("eviction_rollups")


def _backfill() -> sa.Select:
    evictions = sa.table(
        "evictions",
        sa.column("run_id"),
        sa.column("time", sa.Double),
        sa.column("reason"),
        sa.column("age_s", sa.Double),
        sa.column("hit_count", sa.Integer),
    )
    scaled = evictions.c.time / float(ROLLUP_SECONDS)
    if op.get_bind().dialect.name == "sqlite":
        minute = sa.cast(scaled, sa.Integer)
    else:
        minute = sa.cast(sa.func.floor(scaled), sa.BigInteger)
    rows = sa.select(
        evictions.c.run_id,
        minute.label("minute"),
        evictions.c.reason,
        *_flags(evictions.c.age_s, AGE_EDGES_S, AGE_BINS),
        *_flags(evictions.c.hit_count, HIT_EDGES, HIT_BINS),
    ).subquery()
    return sa.select(
        rows.c.run_id,
        rows.c.minute,
        rows.c.reason,
        sa.func.count(),
        *(sa.func.sum(rows.c[name]) for name in AGE_BINS + HIT_BINS),
    ).group_by(rows.c.run_id, rows.c.minute, rows.c.reason)


def _flags(column, edges, names):
    flags = []
    for index, name in enumerate(names):
        inside = [column >= edges[index - 1] if index else column.is_not(None)]
        if index < len(edges):
            inside.append(column < edges[index])
        flags.append(sa.case((sa.and_(*inside), 1), else_=0).label(name))
    return flags
