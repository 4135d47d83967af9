"""Checking engine outputs against the transformers reference on the same weights.

`LogitSpy` wraps the engine's real runner and records, per request, the logits every sampled token was
drawn from, and every position the model was run on. `assert_matches_reference` recomputes each of those
logits with a plain full forward of an independently loaded copy of the model (transformers' own SDPA
attention, no cache) and compares: logits within 1e-4 and greedy tokens equal.
"""

from __future__ import annotations

import torch

from engine.engine import Engine
from engine.runner.model_loading import LoadedModel

ATOL = 1e-4


class LogitSpy:
    def __init__(self, engine: Engine) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.positions: dict[str, list[int]] = {}  # every position each request ran through the model
        schedule, execute = engine.scheduler.schedule, engine.runner.execute
        pending: list = []

        def spy_schedule():
            out = schedule()
            pending[:] = out.chunks
            return out

        def spy_execute(chunks):
            logits = execute(chunks)
            for chunk, row in zip(pending, logits):
                rid = chunk.request.request_id
                self.positions.setdefault(rid, []).extend(
                    range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))
                )
                if chunk.reaches_end:
                    self.logits.setdefault(rid, []).append(row.detach().float().cpu().clone())
            return logits

        engine.scheduler.schedule = spy_schedule
        engine.runner.execute = spy_execute


@torch.inference_mode()
def reference_logits(reference: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([token_ids], device=reference.device)
    return reference.model(input_ids=ids, use_cache=False).logits[0, -1].float().cpu()


def assert_matches_reference(engine: Engine, spy: LogitSpy, reference: LoadedModel, request_id: str) -> None:
    view = engine.get(request_id)
    prompt, output = list(view.prompt_token_ids), list(view.output_token_ids)
    recorded = spy.logits[request_id]
    # After a preemption the last sampled position is recomputed and sampled again: keep the final ones.
    recorded = recorded[-len(output) :]
    assert len(recorded) == len(output)
    for k, (got, token) in enumerate(zip(recorded, output)):
        want = reference_logits(reference, prompt + output[:k])
        diff = (got - want).abs().max().item()
        assert diff < ATOL, f"{request_id}: logits of token {k} differ by {diff}"
        assert int(want.argmax()) == token, f"{request_id}: greedy token {k} differs from the reference"
