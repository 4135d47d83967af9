"""The writer-progress table: what each writer process has committed, for exact counts after a crash.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "writer_progress",
        sa.Column("writer_id", sa.String(), primary_key=True),
        sa.Column("written_events", sa.BigInteger, nullable=False),
        sa.Column("written_requests", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_index("ix_writer_progress_updated_at", "writer_progress", ["updated_at"])


def downgrade() -> None:
    op.drop_table("writer_progress")
