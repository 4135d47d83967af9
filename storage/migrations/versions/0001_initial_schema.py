"""The first schema: runs, requests, events, evictions.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("weights_revision", sa.String()),
        sa.Column("namespace", sa.String()),
        sa.Column("num_blocks", sa.Integer, nullable=False),
        sa.Column("block_size", sa.Integer, nullable=False),
        sa.Column("dtype", sa.String(), nullable=False),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("started_at", sa.Double, nullable=False),
        sa.Column("stopped_at", sa.Double),
    )
    op.create_index("ix_runs_started_at", "runs", ["started_at"])

    op.create_table(
        "requests",
        sa.Column("run_id", sa.String(), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("request_id", sa.String(), primary_key=True),
        sa.Column("parent_id", sa.String()),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("output_token_ids", sa.JSON, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("computed_tokens", sa.Integer, nullable=False),
        sa.Column("hit_source", sa.String(), nullable=False),
        sa.Column("cow_copies", sa.Integer, nullable=False),
        sa.Column("preemptions", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.String()),
        sa.Column("arrival_time", sa.Double, nullable=False),
        sa.Column("first_scheduled_time", sa.Double),
        sa.Column("first_token_time", sa.Double),
        sa.Column("finish_time", sa.Double),
    )
    op.create_index("ix_requests_arrival_time", "requests", ["arrival_time"])
    op.create_index("ix_requests_first_scheduled_time", "requests", ["first_scheduled_time"])

    op.create_table(
        "events",
        sa.Column("id", ROW_ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("time", sa.Double, nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("request_id", sa.String()),
        sa.Column("block_id", sa.Integer),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
    )
    op.create_index("ix_events_time", "events", ["time"])
    op.create_index("ix_events_request", "events", ["request_id", "run_id"])

    op.create_table(
        "evictions",
        sa.Column("id", ROW_ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("time", sa.Double, nullable=False),
        sa.Column("block_id", sa.Integer),
        sa.Column("key_hex", sa.String()),
        sa.Column("start_pos", sa.Integer),
        sa.Column("end_pos", sa.Integer),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("age_s", sa.Double),
        sa.Column("hit_count", sa.Integer),
        sa.Column("last_used", sa.Double),
        sa.Column("group", sa.String()),
        sa.Column("request_id", sa.String()),
    )
    op.create_index("ix_evictions_time", "evictions", ["time"])
    op.create_index("ix_evictions_reason_time", "evictions", ["reason", "time"])
    op.create_index("ix_evictions_run_time", "evictions", ["run_id", "time"])
    op.create_index("ix_evictions_key", "evictions", ["key_hex"])
    op.create_index("ix_evictions_request", "evictions", ["request_id"])


def downgrade() -> None:
    for table in ("evictions", "events", "requests", "runs"):
        op.drop_table(table)
