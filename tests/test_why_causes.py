"""The miss diagnosis over hand-made history rows: each cause, its position and its evidence, exactly."""

from __future__ import annotations

from analysis.why import ANALYZER_REASONS, Cause, Decoder, WhyError, diagnose, summarize
from storage.read.why import WhyEviction, WhyRequest

BS = 4
PLAIN = Decoder.of(None)


def row(request_id: str, prompt: list[int] | None, *, cached: int = 0, arrival: float, salt: str | None = None,
        run: str = "run-a", namespace: str = "ns-a", keys: bytes | None = None, scheduled: float | None = None,
        first_token: float | None = None) -> WhyRequest:  # fmt: skip
    return WhyRequest(
        run_id=run, request_id=request_id, status="finished", arrival_time=arrival,
        first_scheduled_time=arrival if scheduled is None else scheduled,
        first_token_time=(arrival + 0.5) if first_token is None else first_token,
        prompt_token_ids=None if prompt is None else tuple(prompt), salt=salt, cached_tokens=cached,
        prompt_tokens=0 if prompt is None else len(prompt), hit_source="prefix" if cached else "none",
        block_keys=keys, replay_mode="none", r=0, namespace=namespace, block_size=BS, model="tiny-llama",
        dtype="float32", weights_revision="w1",
    )  # fmt: skip


def no_evictions(run_id: str, key_hex: str, before: float) -> None:
    return None


PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks before the last token


def test_a_prompt_no_earlier_request_shared_a_block_of_is_new() -> None:
    earlier = [row("a", [99, 98, 97, 96, 95], arrival=1.0)]
    diagnosis = diagnose(row("b", PROMPT, arrival=2.0), earlier, no_evictions, PLAIN)
    assert (diagnosis.cause, diagnosis.position, diagnosis.missed_tokens, diagnosis.match) == (Cause.NEW, 0, 12, None)


def test_every_full_block_before_the_last_token_served_is_a_hit_even_with_a_partial_tail() -> None:
    diagnosis = diagnose(row("b", PROMPT, cached=12, arrival=2.0), [row("a", PROMPT, arrival=1.0)], no_evictions, PLAIN)
    assert (diagnosis.cause, diagnosis.missed_tokens, diagnosis.reusable_tokens) == (Cause.HIT, 0, 12)


def test_a_prompt_that_differs_after_six_shared_tokens_diverged_there() -> None:
    theirs = PROMPT[:6] + [500, 501, 502, 503, 504, 505, 506]
    diagnosis = diagnose(row("b", PROMPT, cached=4, arrival=2.0), [row("a", theirs, arrival=1.0)], no_evictions, PLAIN)
    assert diagnosis.cause is Cause.DIVERGED and diagnosis.position == 4
    assert diagnosis.match == {"request_id": "a", "run_id": "run-a", "shared_tokens": 6}
    assert diagnosis.divergence["position"] == 6
    assert diagnosis.divergence["ours"] == "16 17 18 19 20 21 22"
    assert diagnosis.divergence["theirs"] == "500 501 502 503 504 505 506"
    assert diagnosis.divergence["before"] == "10 11 12 13 14 15"


def test_a_block_an_earlier_request_held_and_lost_is_evicted_with_the_evictions_reason() -> None:
    keys = bytes(range(16)) + bytes(range(16, 32)) + bytes(range(32, 48))
    seen = []

    def evictions(run_id: str, key_hex: str, before: float) -> WhyEviction:
        seen.append((run_id, key_hex, before))
        return WhyEviction(at=1.5, reason="lru", block=7, key_hex=key_hex, group="full")

    diagnosis = diagnose(row("b", PROMPT, cached=4, arrival=2.0), [row("a", PROMPT, arrival=1.0, keys=keys)],
                         evictions, PLAIN)  # fmt: skip
    assert diagnosis.cause is Cause.EVICTED and diagnosis.position == 4 and diagnosis.reusable_tokens == 12
    assert seen == [("run-a", bytes(range(16, 32)).hex(), 2.0)]  # the key of the block at position 4
    assert diagnosis.eviction == {"at": 1.5, "reason": "lru", "block": 7, "key": bytes(range(16, 32)).hex(),
                                  "group": "full"}  # fmt: skip


def test_the_same_tokens_under_another_salt_are_a_namespace_miss_naming_both_salts() -> None:
    earlier = [row("a", PROMPT, arrival=1.0, salt="tenant-1")]
    diagnosis = diagnose(row("b", PROMPT, arrival=2.0, salt="tenant-2"), earlier, no_evictions, PLAIN)
    assert diagnosis.cause is Cause.NAMESPACE and diagnosis.namespace == {"salt": ["tenant-2", "tenant-1"]}
    assert diagnosis.reusable_tokens == 0 and diagnosis.missed_tokens == 12


def test_a_hit_that_waited_for_another_request_computing_its_prefix_says_for_whom() -> None:
    first = row("a", PROMPT, arrival=1.0, scheduled=1.0, first_token=1.2)
    second = row("b", PROMPT, cached=12, arrival=1.01, scheduled=1.2)
    diagnosis = diagnose(second, [first], no_evictions, PLAIN)
    assert diagnosis.cause is Cause.HIT
    assert diagnosis.wait == {"seconds": 1.2 - 1.01, "request_id": "a", "shared_tokens": 13}


def test_a_request_without_a_recorded_prompt_cannot_be_explained() -> None:
    try:
        diagnose(row("b", None, arrival=2.0), [], no_evictions, PLAIN)
    except WhyError as exc:
        assert "not in the history" in str(exc)
    else:
        raise AssertionError("expected WhyError")


def test_a_runs_summary_counts_missed_tokens_by_cause() -> None:
    requests = [row("a", PROMPT, arrival=1.0), row("b", PROMPT, cached=12, arrival=2.0),
                row("c", PROMPT[:6] + [400] * 7, cached=4, arrival=3.0)]  # fmt: skip
    summary, diagnoses = summarize("run-a", requests, [], no_evictions, PLAIN)
    assert [d.cause for d in diagnoses] == [Cause.NEW, Cause.HIT, Cause.DIVERGED]
    assert summary.by_cause["new"] == {"requests": 1, "missed_tokens": 12}
    assert summary.by_cause["diverged"] == {"requests": 1, "missed_tokens": 8}
    assert summary.by_cause["hit"] == {"requests": 1, "missed_tokens": 0}


def test_causes_that_mean_an_analyzer_reason_carry_its_name() -> None:
    assert ANALYZER_REASONS == {Cause.NEW: "compulsory", Cause.DIVERGED: "compulsory", Cause.EVICTED: "capacity",
                                Cause.NAMESPACE: "namespace"}  # fmt: skip
