"""What holds between an engine's requests and the parts that keep state for them.

Checked by `Engine.check_invariants` (engine/engine.py), beside the KV groups' own invariants:

    * the request table's own (engine/core/request_table.py);
    * per-request state is held for live requests only: no seeded generator, block table or scheduler
      queue entry outlives its request, and no request is queued twice;
    * a live request has a block table exactly when its status holds blocks (or it is a waiting fork
      child that holds its parent's shared blocks), and that table covers its computed tokens.
"""

from __future__ import annotations

from collections.abc import Collection

from engine.core.errors import require
from engine.core.kv_coordinator import KVCoordinator
from engine.core.request import RequestStatus
from engine.core.request_table import RequestTable
from engine.core.scheduler import Scheduler


def check_request_state(
    table: RequestTable, kv: KVCoordinator, scheduler: Scheduler, generator_ids: Collection[str]
) -> None:
    """Raise InvariantError if an invariant of the module docstring is broken."""
    table.check_invariants()
    live = table.live.keys()
    require(set(generator_ids) <= live, "a generator outlived its request")
    for manager in kv.managers:
        require(manager.tables().keys() <= live, "a block table outlived its request")
    queued = [r.request_id for r in (*scheduler.waiting, *scheduler.running)]
    require(len(queued) == len(set(queued)) and set(queued) <= live, "the scheduler queues a request that left")
    for request in table.live.values():
        rid = request.request_id
        holds = request.status.holds_blocks or (request.status is RequestStatus.WAITING and kv.has_table(rid))
        require(holds == kv.has_table(rid), f"{rid}: table mismatch")
        if holds:
            require(kv.num_tokens(rid) == request.num_computed_tokens, f"{rid}: computed tokens mismatch")
