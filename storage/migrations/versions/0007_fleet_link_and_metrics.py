"""Fleet link state and metrics: each source's link, heartbeat, lost batches and restarts; a pod's /metrics.

Revision ID: 0007
Revises: 0006

fleet_sources gains what `python -m cli fleet state` needs to tell a pod that is watched and live from
one that is down, unreachable or incomplete, and a collector that stopped without closing its sources
(its heartbeat, `status_at`, grows old). fleet_metrics holds the scrapes of each pod's /metrics (KV
usage, the prefix-cache counters, preemptions, running and waiting requests, the pool's capacity), so
the History view can show them. New nullable columns and a new table: existing rows stay valid.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("fleet_sources") as batch:
        batch.add_column(sa.Column("link", sa.String()))
        batch.add_column(sa.Column("status_at", sa.Double))
        batch.add_column(sa.Column("num_lost_batches", sa.BigInteger))
        batch.add_column(sa.Column("num_restarts", sa.Integer))
    op.create_table(
        "fleet_metrics",
        sa.Column("id", ROW_ID, primary_key=True, autoincrement=True),
        sa.Column("source_id", sa.String(), nullable=False),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("prefix_cache_queries", sa.Double),
        sa.Column("prefix_cache_hits", sa.Double),
        sa.Column("num_preemptions", sa.Double),
        sa.Column("kv_cache_usage", sa.Double),
        sa.Column("num_running", sa.Double),
        sa.Column("num_waiting", sa.Double),
        sa.Column("num_gpu_blocks", sa.Integer),
        sa.Column("error", sa.String()),
    )
    op.create_index("ix_fleet_metrics_source_at", "fleet_metrics", ["source_id", "at"])


def downgrade() -> None:
    op.drop_table("fleet_metrics")
    with op.batch_alter_table("fleet_sources") as batch:
        for name in ("num_restarts", "num_lost_batches", "status_at", "link"):
            batch.drop_column(name)
