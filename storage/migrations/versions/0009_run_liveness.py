"""Run liveness: who owns each run, its writer's heartbeat, and how it ended.

Revision ID: 0009
Revises: 0008

runs gains `host` and `pid` (the process that owns the run), `heartbeat_at` (the wall clock of its
writer's last sign of life) and `end_reason` ("stopped" by its writer, or "interrupted": closed by a
later start after its owner died; storage.write.run_liveness). New nullable columns: existing rows stay
valid, and an older run without an end is judged by its start time alone.
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("host", sa.String()))
        batch.add_column(sa.Column("pid", sa.Integer))
        batch.add_column(sa.Column("heartbeat_at", sa.Double))
        batch.add_column(sa.Column("end_reason", sa.String()))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        for name in ("end_reason", "heartbeat_at", "pid", "host"):
            batch.drop_column(name)
