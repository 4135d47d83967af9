"""Sliding-window replay fields on requests; the retention log table.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
WINDOW_COLUMNS = ("h", "s", "e", "r", "replay_mode", "replayed_tokens")


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        for name in ("h", "s", "e", "r"):
            batch.add_column(sa.Column(name, sa.Integer))
        batch.add_column(sa.Column("replay_mode", sa.String()))
        batch.add_column(sa.Column("replayed_tokens", sa.Integer))

    op.create_table(
        "prunes",
        sa.Column("id", ROW_ID, primary_key=True, autoincrement=True),
        sa.Column("time", sa.Double, nullable=False),
        sa.Column("table_name", sa.String(), nullable=False),
        sa.Column("rows_deleted", sa.Integer, nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
    )
    op.create_index("ix_prunes_time", "prunes", ["time"])


def downgrade() -> None:
    op.drop_table("prunes")
    with op.batch_alter_table("requests") as batch:
        for name in reversed(WINDOW_COLUMNS):
            batch.drop_column(name)
