"""The disk KV tier in the history: each request's disk-served tokens, and the tier's log.

Revision ID: 0010
Revises: 0009

requests gains `disk_cached_tokens` (of `cached_tokens`, those promoted from the disk tier; 0 in older
rows, written before the engine had a tier). `tier_moves` is new: one row per block a DEMOTE, PROMOTE,
TIER_EVICT or TIER_DROP event moved (storage.write.rows.tier_move_values). Tier events stored before this
revision stay in `events` only.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# storage.schema.RowId, frozen at this revision.
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("disk_cached_tokens", sa.Integer, nullable=False, server_default="0"))
    op.create_table(
        "tier_moves",
        sa.Column("id", ROW_ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("time", sa.Double, nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("key_hex", sa.String()),
        sa.Column("block_id", sa.Integer),
        sa.Column("request_id", sa.String()),
        sa.Column("slot", sa.Integer),
        sa.Column("reason", sa.String()),
        sa.Column("tokens", sa.Integer, nullable=False),
    )
    op.create_index("ix_tier_moves_time", "tier_moves", ["time"])
    op.create_index("ix_tier_moves_run_kind", "tier_moves", ["run_id", "kind"])
    op.create_index("ix_tier_moves_key", "tier_moves", ["key_hex"])


def downgrade() -> None:
    op.drop_table("tier_moves")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("disk_cached_tokens")
