"""Measuring how far an approximate window replay drifted from a from-scratch computation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.events import EventKind, EventLog
from engine.core.kv_groups import ReplayMode
from engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class Divergence:
    """Per-token comparison of the logits a request sampled from against a from-scratch forward."""

    num_tokens: int  # output tokens compared
    max_abs_logit: float  # max |logit - reference logit| over all compared tokens and the vocabulary
    mean_kl: float  # mean KL(reference || replayed) in nats
    max_kl: float
    top1_agreement: float  # fraction of tokens whose argmax agrees with the reference

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def divergence(replayed: torch.Tensor, reference: torch.Tensor) -> Divergence:
    """Compare [n, vocab] logits row by row (the same positions, teacher-forced on the same tokens)."""
    if replayed.shape != reference.shape or replayed.shape[0] == 0:
        raise ValueError(f"need two equal non-empty [n, vocab] tensors, got {tuple(replayed.shape)}, {tuple(reference.shape)}")
    replayed, reference = replayed.float(), reference.float()
    log_p = torch.log_softmax(reference, dim=-1)
    log_q = torch.log_softmax(replayed, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return Divergence(
        num_tokens=replayed.shape[0],
        max_abs_logit=(replayed - reference).abs().max().item(),
        mean_kl=kl.mean().item(),
        max_kl=kl.max().item(),
        top1_agreement=(replayed.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    )


class ReplayVerifier:
    """Measures every approximate replay against a from-scratch forward (the engine builds one only when
    `verify_replay` is on).

    `capture` keeps the logits each approximately replayed request sampled from; when the request finishes,
    `verify` recomputes its whole context with transformers' own attention (under the engine lock, so
    the step that finishes it takes that much longer), records the divergence on the request and emits a
    REPLAY event with it.
    """

    def __init__(self, runner: ModelRunner, log: EventLog) -> None:
        self._runner = runner
        self._log = log
        self._logits: dict[str, list[torch.Tensor]] = {}  # request id -> sampled-from rows, in order

    def capture(self, requests: Sequence[Request], logits: torch.Tensor) -> None:
        """Keep row i of `logits` (what requests[i] samples from) for the approximately replayed ones."""
        for request, row in zip(requests, logits):
            if request.replay_mode is ReplayMode.APPROXIMATE:
                self._logits.setdefault(request.request_id, []).append(row.cpu())

    def verify(self, request: Request) -> None:
        """For a finished request with captured logits: compare them with a from-scratch forward. A
        request that ended unfinished (failed, aborted) only has its logits dropped."""
        recorded = self._logits.pop(request.request_id, None)
        if not recorded or request.status not in (RequestStatus.FINISHED, RequestStatus.RETAINED):
            return
        # After a preemption the last sampled positions were sampled again: the final rows are the outputs'.
        n = min(len(recorded), len(request.output_token_ids))
        reference = self._runner.reference_logits(request.all_token_ids[:-1])[-n:].cpu()
        measured = divergence(torch.stack(recorded[-n:]), reference).as_dict()
        request.replay_verified(measured)
        detail = {"mode": request.replay_mode.value, "verified": True, **measured}
        self._log.emit(EventKind.REPLAY, detail, request_id=request.request_id, tokens=request.replayed_tokens)
