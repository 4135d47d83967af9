"""The miss diagnosis over hand-made history rows: each cause, its position and its evidence, exactly."""

from __future__ import annotations

from analysis.why import ANALYZER_REASONS, MAX_WORD_CANDIDATES, Cause, Decoder, WhyError, diagnose, summarize
from storage.read.why import WhyEviction, WhyRequest

BS = 4
PLAIN = Decoder.of(None)


def row(request_id: str, prompt: list[int] | None, *, cached: int = 0, arrival: float, salt: str | None = None,
        run: str = "run-a", namespace: str = "ns-a", keys: bytes | None = None, scheduled: float | None = None,
        first_token: float | None = None, output: list[int] = (), parent: str | None = None) -> WhyRequest:  # fmt: skip
    return WhyRequest(
        run_id=run, request_id=request_id, status="finished", arrival_time=arrival,
        first_scheduled_time=arrival if scheduled is None else scheduled,
        first_token_time=(arrival + 0.5) if first_token is None else first_token,
        prompt_token_ids=None if prompt is None else tuple(prompt), output_token_ids=tuple(output),
        parent_id=parent, salt=salt, cached_tokens=cached, prompt_tokens=0 if prompt is None else len(prompt),
        hit_source="fork" if parent else "prefix" if cached else "none",
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
    assert (summary.prompt_tokens, summary.cached_tokens, summary.missed_tokens, summary.never_served_tokens) == (
        39, 16, 20, 3)  # 12 + 8 missed; each 13-token prompt's last token (issue 47 item 12)


def test_causes_that_mean_an_analyzer_reason_carry_its_name() -> None:
    assert ANALYZER_REASONS == {Cause.NEW: "compulsory", Cause.DIVERGED: "compulsory", Cause.EXTENDED: "compulsory",
                                Cause.EVICTED: "capacity", Cause.BOTH_TIERS: "capacity",
                                Cause.NAMESPACE: "namespace"}  # fmt: skip


def test_a_next_turn_that_holds_the_previous_turns_reply_is_compared_with_that_reply() -> None:
    """Issue 47 item 9: only earlier prompts were compared, so a chat's turn 2 "diverged" where turn 1's
    prompt ended (theirs: nothing), though the cache served turn 1's reply too."""
    turn_1 = row("t1", PROMPT[:5], arrival=1.0, output=[30, 31, 32, 33, 34, 35])  # context 5 + 5 computed
    turn_2 = PROMPT[:5] + [30, 31, 32, 33, 34, 35, 40, 41, 42, 43, 44, 45]  # 17 tokens: 4 cacheable blocks
    diagnosis = diagnose(row("t2", turn_2, cached=8, arrival=2.0), [turn_1], no_evictions, PLAIN)
    assert diagnosis.cause is Cause.EXTENDED and diagnosis.as_json()["analyzer_reason"] == "compulsory"
    assert diagnosis.match == {"request_id": "t1", "run_id": "run-a", "shared_tokens": 10}
    assert diagnosis.divergence["position"] == 10 and diagnosis.divergence["theirs"] == ""
    assert diagnosis.divergence["ours"] == "35 40 41 42 43 44 45"  # t1's last token was sampled, never computed
    assert any("t1's cached context" in note for note in diagnosis.divergence["notes"])
    assert (diagnosis.reusable_tokens, diagnosis.missed_tokens) == (8, 8)


def test_a_reply_that_differs_from_what_the_next_turn_holds_diverges_inside_the_reply() -> None:
    turn_1 = row("t1", PROMPT[:5], arrival=1.0, output=[30, 31, 32, 33, 34, 35, 36])
    turn_2 = PROMPT[:5] + [30, 31, 32, 99, 98, 97, 96, 95, 94, 93]
    diagnosis = diagnose(row("t2", turn_2, cached=8, arrival=2.0), [turn_1], no_evictions, PLAIN)
    assert diagnosis.cause is Cause.DIVERGED and diagnosis.match["shared_tokens"] == 8
    assert diagnosis.divergence["ours"] == "99 98 97 96 95 94 93"
    assert diagnosis.divergence["theirs"] == "33 34 35"


def test_a_block_of_an_earlier_reply_that_was_evicted_names_the_eviction_by_this_requests_own_key() -> None:
    keys = bytes(range(16)) + bytes(range(16, 32)) + bytes(range(32, 48))
    seen = []

    def evictions(run_id: str, key_hex: str, before: float) -> WhyEviction:
        seen.append(key_hex)
        return WhyEviction(at=1.5, reason="lru", block=3, key_hex=key_hex, group="full")

    turn_1 = row("t1", PROMPT[:3], arrival=1.0, output=PROMPT[3:] + [77])  # its prompt holds no full block
    diagnosis = diagnose(row("t2", PROMPT, cached=4, arrival=2.0, keys=keys), [turn_1], evictions, PLAIN)
    assert diagnosis.cause is Cause.EVICTED and seen == [bytes(range(16, 32)).hex()]


def two_chat_prompts_through_one_template() -> tuple[list[int], list[int], Decoder]:
    start, end = 1, 2  # <|im_start|>, <|im_end|>
    decoder = Decoder(lambda ids: " ".join(map(str, ids)), lambda ids: " ".join(str(t) for t in ids if t > 2),
                      lambda: frozenset({0, start, end}))  # fmt: skip
    system = [start, 50, 51, 52, 53, 54, 55, end]
    ours = system + [start, 60, 61, 62, 63, 64, end, start, 70]
    theirs = system + [start, 60, 61, *range(66, 86), end, start, 70]  # no special token in its window
    return ours, theirs, decoder


def test_two_prompts_rendered_through_the_same_template_are_not_called_a_template_difference() -> None:
    """Issue 47 item 10: the special tokens before the divergence and in unequal windows after it were
    compared, so two chats through one template were said to differ in their template."""
    ours, theirs, decoder = two_chat_prompts_through_one_template()
    diagnosis = diagnose(row("b", ours, cached=8, arrival=2.0), [row("a", theirs, arrival=1.0)], no_evictions, decoder)
    assert diagnosis.cause is Cause.DIVERGED and diagnosis.divergence["position"] == 11
    assert not any("template" in note for note in diagnosis.divergence["notes"])
    assert diagnosis.divergence["template"] is None
    assert diagnosis.divergence["template_tokens"] == {"ours": ["2", "1"], "theirs": []}  # the windows' only


def test_a_template_on_one_side_only_names_that_side() -> None:
    ours, _, decoder = two_chat_prompts_through_one_template()
    plain = [t for t in ours if t > 2]
    diagnosis = diagnose(row("b", ours, arrival=2.0), [row("a", plain, arrival=1.0)], no_evictions, decoder)
    assert diagnosis.cause is Cause.DIVERGED and diagnosis.divergence["template"] == "ours"
    assert any("only this request was rendered through a chat template" in n for n in diagnosis.divergence["notes"])


def test_a_fork_child_is_a_fork_of_its_parent_not_a_hit_that_waited_for_its_sibling() -> None:
    """Issue 47 item 11: a child served its parent's 1.5 blocks was "hit, cached 6/8, reusable 4" and
    "waited for child-a"."""
    parent = row("parent", PROMPT[:6], arrival=1.0, output=[40])
    context = PROMPT[:6] + [40]
    child_a = row("child-a", context + [41], cached=6, arrival=2.0, scheduled=2.0, parent="parent")
    child_b = row("child-b", context + [42], cached=6, arrival=2.0, scheduled=2.01, parent="parent")
    diagnosis = diagnose(child_b, [parent, child_a], no_evictions, PLAIN)
    assert diagnosis.cause is Cause.FORK and diagnosis.wait is None
    assert diagnosis.match == {"request_id": "parent", "run_id": "run-a", "shared_tokens": 6}
    assert (diagnosis.cached_tokens, diagnosis.reusable_tokens, diagnosis.missed_tokens) == (6, 6, 0)
    assert diagnosis.never_served_tokens == 2


def test_cached_missed_and_never_served_tokens_add_up_to_the_prompt() -> None:
    """Issue 47 item 12: "16 / 119 cached, missed 96": the last token and the partial block were not shown."""
    earlier = [row("a", PROMPT[:6] + [500] * 7, arrival=1.0)]
    diagnosis = diagnose(row("b", PROMPT, cached=4, arrival=2.0), earlier, no_evictions, PLAIN)
    assert (diagnosis.cached_tokens, diagnosis.missed_tokens, diagnosis.never_served_tokens) == (4, 8, 1)
    answer = diagnosis.as_json()
    assert answer["cached_tokens"] + answer["missed_tokens"] + answer["never_served_tokens"] == answer["prompt_tokens"]
    long = list(range(100, 119))  # 19 tokens: 4 full blocks before the last token, 2 never served
    assert diagnose(row("c", long, arrival=3.0), [], no_evictions, PLAIN).never_served_tokens == 3


def test_the_same_words_are_looked_for_in_the_newest_earlier_requests_only() -> None:
    """Each candidate costs a decode: a new prompt on a long history decoded all 20,000 earlier prompts."""
    decoded = []

    def visible(ids) -> str:
        decoded.append(tuple(ids))
        return " ".join(map(str, ids))

    decoder = Decoder(visible, visible, frozenset)
    words = [row("words", PROMPT[::-1], arrival=0.5)]  # the same numbers as ours, in another order: no match
    others = [row(f"o{i}", [900 + i % 50] * 5, arrival=1.0 + i) for i in range(MAX_WORD_CANDIDATES + 100)]
    diagnosis = diagnose(row("b", PROMPT, arrival=10_000.0), words + others, no_evictions, decoder)
    assert diagnosis.cause is Cause.NEW and len(decoded) == 1 + MAX_WORD_CANDIDATES
