"""The prompt's full-block keys on requests, for the workload analyzer.

Revision ID: 0004
Revises: 0003

`block_keys` holds the chain keys of a finished request's full prompt blocks, 16 bytes each,
concatenated; `content_keys` the same blocks' namespace-free keys (engine/core/request.py's PromptKeys).
Both stay NULL until the request finishes, and for rows written before this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

KEY_COLUMNS = ("block_keys", "content_keys")


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        for name in KEY_COLUMNS:
            batch.add_column(sa.Column(name, sa.LargeBinary))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        for name in reversed(KEY_COLUMNS):
            batch.drop_column(name)
