"""Writer progress counts other producers' rows: a writer process's committed fleet rows survive a crash.

Revision ID: 0008
Revises: 0007

writer_progress gains written_other, the rows handed to a writer through `submit_rows` (the fleet
collector's) that it has committed, saved in the same transaction as those rows, so a writer process
that replaces a killed one knows them exactly. Rows written before this revision hold 0: their writers
did not count these rows there.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("writer_progress") as batch:
        batch.add_column(sa.Column("written_other", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("writer_progress") as batch:
        batch.drop_column("written_other")
