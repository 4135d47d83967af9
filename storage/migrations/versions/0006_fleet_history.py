"""Fleet history: the sources KV-event collectors watch, their events, held blocks and evictions.

Revision ID: 0006
Revises: 0003

New tables only (nothing existing changes), so this revision can follow any later one when the chain
is re-linked. The tables are frozen copies of storage.schema' fleet section at this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _source_id() -> sa.Column:
    """fleet_sources.id, without a FOREIGN KEY (see storage.schema' fleet section)."""
    return sa.Column("source_id", sa.String(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "fleet_sources",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("collector_id", sa.String(), nullable=False),
        sa.Column("pod", sa.String(), nullable=False),
        sa.Column("endpoint", sa.String(), nullable=False),
        sa.Column("replay_endpoint", sa.String()),
        sa.Column("topic", sa.String(), nullable=False),
        sa.Column("metrics_url", sa.String()),
        sa.Column("opened_at", sa.Double, nullable=False),
        sa.Column("closed_at", sa.Double),
    )
    op.create_index("ix_fleet_sources_collector_id", "fleet_sources", ["collector_id"])
    op.create_index("ix_fleet_sources_pod_opened", "fleet_sources", ["pod", "opened_at"])

    op.create_table(
        "fleet_events",
        sa.Column("id", ROW_ID, primary_key=True, autoincrement=True),
        _source_id(),
        sa.Column("seq", sa.BigInteger),
        sa.Column("ts", sa.Double, nullable=False),
        sa.Column("received_at", sa.Double, nullable=False),
        sa.Column("origin", sa.String()),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("medium", sa.String()),
        sa.Column("group_idx", sa.Integer),
        sa.Column("num_blocks", sa.Integer, nullable=False),
        sa.Column("block_hashes", sa.JSON),
        sa.Column("parent_hash", sa.String()),
        sa.Column("block_size", sa.Integer),
    )
    op.create_index("ix_fleet_events_source_ts", "fleet_events", ["source_id", "ts"])

    op.create_table(
        "fleet_blocks",
        sa.Column("source_id", sa.String(), primary_key=True),
        sa.Column("n", sa.BigInteger, primary_key=True),
        sa.Column("medium", sa.String(), nullable=False),
        sa.Column("group_idx", sa.Integer, nullable=False),
        sa.Column("block_hash", sa.String(), nullable=False),
        sa.Column("parent_hash", sa.String()),
        sa.Column("block_size", sa.Integer, nullable=False),
        sa.Column("token_ids", sa.JSON),
        sa.Column("copies", sa.Integer, nullable=False),
        sa.Column("stored_at", sa.Double, nullable=False),
    )

    op.create_table(
        "fleet_evictions",
        sa.Column("id", ROW_ID, primary_key=True, autoincrement=True),
        _source_id(),
        sa.Column("time", sa.Double, nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("medium", sa.String(), nullable=False),
        sa.Column("group_idx", sa.Integer, nullable=False),
        sa.Column("block_hash", sa.String(), nullable=False),
        sa.Column("age_s", sa.Double),
        sa.Column("copies_left", sa.Integer),
    )
    op.create_index("ix_fleet_evictions_source_time", "fleet_evictions", ["source_id", "time"])


def downgrade() -> None:
    for name in ("fleet_evictions", "fleet_blocks", "fleet_events", "fleet_sources"):
        op.drop_table(name)
