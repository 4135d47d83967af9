"""Cascade (shared-prefix) attention: the merge, the plan, and the runner against its plain path.

The property test builds random block tables: families of a parent context and forks that share 0 to
all of its full blocks, each fork with its own cached blocks, then one step mixing decodes and prefill
chunks of every fork (and the parents), on a full-attention model and on one with a sliding-window KV
group. The runner that reads every shared run once must give the logits of the runner that never does
(within 1e-5), and both those of the transformers reference (within 1e-4, same greedy token).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from engine.runner.attention_kernels import HeadLayout, Kernel, attend, choose_kernels, merge_into, merge_partials
from engine.runner.attention_plan import (
    ALWAYS_CASCADE,
    NO_CASCADE,
    CascadeRule,
    ChunkQueries,
    IndexPack,
    KeySource,
    plan_group,
)
from engine.core.config import EngineConfig
from engine.runner.model_runner import GroupSlots, ModelRunner, SeqChunk
from tests.cascade_support import (  # noqa: F401  (runners is a fixture)
    BLOCK_SIZE,
    NUM_BLOCKS,
    SCENARIO_MODELS,
    run_scenario,
    runners,
    scenarios,
    tokens,
)

ATOL_REFERENCE = 1e-4
ATOL_PLAIN = 1e-5


# ---------------------------------------------------------------------------------------------- kernels
def random_call(batch: int, heads: int, kv_heads: int, queries: int, keys: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, 16, generator=generator)
    k = torch.randn(batch, kv_heads, keys, 16, generator=generator)
    v = torch.randn(batch, kv_heads, keys, 16, generator=generator)
    return q, k, v


@pytest.mark.parametrize("kernel", [Kernel.CPU_TILED, Kernel.CPU_FLASH, Kernel.MATH])
def test_two_partial_results_merge_into_attention_over_all_keys(kernel):
    q, k, v = random_call(2, 4, 2, 3, 29, seed=1)
    whole, whole_lse = attend(q, k, v, scale=0.25, kernel=kernel)
    out_a, lse_a = attend(q, k[:, :, :11], v[:, :, :11], scale=0.25, kernel=kernel)
    out_b, lse_b = attend(q, k[:, :, 11:], v[:, :, 11:], scale=0.25, kernel=kernel)
    merged = merge_partials(out_a, lse_a, out_b, lse_b)
    assert (merged - whole).abs().max().item() < 1e-6
    assert (torch.logaddexp(lse_a, lse_b) - whole_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_into_writes_the_merge_in_place_into_a_view(dtype):
    """The runner merges a shared call's results into rows of its step output (a slice) in one pass."""
    generator = torch.Generator().manual_seed(7)
    output = torch.randn(10, 4, 32, generator=generator).to(dtype)
    lse = torch.randn(4, 10, generator=generator).t()  # strided, as any [R, H] view may be
    out_b = torch.randn(6, 4, 32, generator=generator).to(dtype)
    lse_b = torch.randn(6, 4, generator=generator) * 8
    lse_b[0, 0] = 1e4  # one side dominating by far stays finite
    want = merge_partials(output[2:8], lse[2:8], out_b, lse_b)
    untouched = output.clone()
    merge_into(output[2:8], lse[2:8], out_b, lse_b)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert (output[2:8].float() - want.float()).abs().max().item() <= tolerance
    assert torch.equal(output[:2], untouched[:2]) and torch.equal(output[8:], untouched[8:])


def test_merge_is_finite_when_one_part_dominates_by_far():
    out_a, out_b = torch.ones(1, 4), torch.zeros(1, 4)
    merged = merge_partials(out_a, torch.tensor([1e4]), out_b, torch.tensor([-1e4]))
    assert torch.equal(merged, out_a)


@pytest.mark.parametrize("kernel", [Kernel.CPU_FLASH, Kernel.MATH])
def test_masked_and_causal_calls_match_full_softmax(kernel):
    q, k, v = random_call(2, 4, 2, 5, 5, seed=2)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()
    expanded_k, expanded_v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q, expanded_k, expanded_v, attn_mask=visible, scale=0.3)
    causal, _ = attend(q, k, v, scale=0.3, causal=True, kernel=kernel)
    bias = torch.zeros(2, 1, 5, 5).masked_fill(~visible, float("-inf"))
    masked, _ = attend(q, k, v, scale=0.3, bias=bias, kernel=kernel)
    assert (causal - want).abs().max().item() < 1e-6
    assert (masked - want).abs().max().item() < 1e-6


@pytest.mark.parametrize(
    ("queries", "keys", "causal", "with_bias"),
    [(1, 9, False, True), (6, 6, True, False), (6, 13, False, False), (4, 13, False, True)],
)
def test_head_layout_for_cuda_kernels_preserves_results(queries, keys, causal, with_bias):
    """The folding / repeating done before a CUDA kernel (which needs equal head counts) changes nothing."""
    q, k, v = random_call(2, 6, 2, queries, keys, seed=3)
    bias = None
    if with_bias:
        visible = torch.rand(2, 1, queries, keys, generator=torch.Generator().manual_seed(4)) < 0.6
        visible[..., 0] = True
        bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    want_out, want_lse = attend(q, k, v, scale=0.25, causal=causal, bias=bias, kernel=Kernel.MATH)
    layout = HeadLayout.of(q, k, causal, bias)
    hq, hk, hv, hbias = layout.apply(q, k, v, bias)
    assert hq.shape[1] == hk.shape[1] and layout.fold == (not causal and (bias is None or queries == 1))
    out, lse = layout.restore(*attend(hq, hk, hv, scale=0.25, causal=causal, bias=hbias, kernel=Kernel.MATH))
    assert (out - want_out).abs().max().item() < 1e-6
    assert (lse - want_lse).abs().max().item() < 1e-5


def test_cpu_runner_uses_its_own_kernels_where_they_apply_and_the_fused_cpu_kernel_for_masked_calls():
    choice = choose_kernels(torch.device("cpu"), torch.float32, 9, 3, 64)
    assert (choice.unmasked, choice.masked, choice.notes) == (Kernel.CPU_TILED, Kernel.CPU_FLASH, ())
    assert choice.decodes is Kernel.CPU_PAGED_DECODE


# ---------------------------------------------------------------------------------------------- plan
def queries_of(tables: list[list[int]], starts: list[int], lengths: list[int]) -> list[ChunkQueries]:
    chunks, row = [], 0
    for table, start, length in zip(tables, starts, lengths):
        chunks.append(ChunkQueries(row, start, length, GroupSlots(table, 0, start)))
        row += length
    return chunks


def rows_of(rows, packed) -> list[int]:
    return list(rows) if isinstance(rows, range) else packed[rows].tolist()


def blocks_of(call, packed) -> list[int]:
    return list(call.blocks) if call.keys is KeySource.VIEW else packed[call.blocks].tolist()


def shared_calls(chunks, rule, window=None):
    pack = IndexPack()
    calls = plan_group(chunks, window, BLOCK_SIZE, rule, pack)
    packed = pack.to(torch.device("cpu"))
    return [(rows_of(c.rows, packed), blocks_of(c, packed)) for c in calls if c.merges], calls


def test_forks_decoding_together_read_their_common_blocks_once():
    parent = [7, 3, 9, 4]  # four full blocks: 16 tokens, scattered
    tables = [parent + [20], parent + [21], parent[:2] + [30, 31, 32], [41, 40, 42, 43, 44]]
    chunks = queries_of(tables, [17, 18, 16, 16], [1, 1, 1, 1])
    shared, calls = shared_calls(chunks, CascadeRule(True, 1))
    # The first three share block 7 at logical 0; all three hold [7, 3] (the third diverges after it).
    # The fourth is alone on scattered blocks: splitting its prefix off would save no copy.
    assert shared == [([0, 1, 2], [7, 3])]
    assert [c.merges for c in calls] == [False, True]  # one padded decode batch, then the shared run
    assert shared_calls(chunks, ALWAYS_CASCADE)[0][1] == ([3], [41, 40, 42, 43])  # always: even a lone chunk


def test_forks_sharing_every_full_block_share_them_all():
    parent = [7, 3, 9, 4]
    chunks = queries_of([parent + [20, 23], parent + [21, 24], parent + [22, 25]], [16, 16, 16], [5, 5, 5])
    shared, calls = shared_calls(chunks, ALWAYS_CASCADE)
    assert shared == [(list(range(15)), parent)]
    own = [c for c in calls if c.causal]
    assert len(own) == 1 and own[0].keys is KeySource.OWN  # their suffixes attend causally to their own K/V


def test_the_rule_counts_the_block_copies_a_layer_saves():
    scattered, consecutive = [7, 3, 9, 4], [8, 9, 10, 11]
    decodes = queries_of([scattered + [20], scattered + [21]], [16, 16], [1, 1])
    assert shared_calls(decodes, CascadeRule(True, 5))[0] == []  # gathered once: (2 - 1) x 4 copies saved
    assert shared_calls(decodes, CascadeRule(True, 4))[0] == [([0, 1], scattered)]
    assert shared_calls(decodes, NO_CASCADE)[0] == []
    lone = queries_of([consecutive + [30, 31]], [16], [5])
    assert shared_calls(lone, CascadeRule(True, 4))[0] == [(list(range(5)), consecutive)]  # read in place: 4 saved
    assert shared_calls(lone, CascadeRule(True, 5))[0] == []
    assert shared_calls(queries_of([scattered + [30, 31]], [16], [5]), CascadeRule(True, 1))[0] == []


def test_a_lone_decode_read_in_place_keeps_its_run_but_decodes_that_share_it_split_it_off():
    """The paged decode kernel reads a lone decode's consecutive blocks in place already: splitting the run
    off would save no copy, only add a call and a merge. Two decodes over it still read it once."""
    consecutive = [8, 9, 10, 11]

    def calls(tables, starts):
        return plan_group(queries_of(tables, starts, [1] * len(tables)), None, BLOCK_SIZE, CascadeRule(True, 4),
                          IndexPack(), decodes_in_place=True)

    assert [(c.keys, c.merges) for c in calls([consecutive + [20]], [16])] == [(KeySource.PAGED, False)]
    two = calls([consecutive + [20], consecutive + [21]], [16, 16])
    assert [(c.keys, c.merges) for c in two] == [(KeySource.PAGED, False), (KeySource.VIEW, True)]
    lone_prefill = plan_group(queries_of([consecutive + [30, 31]], [16], [5]), None, BLOCK_SIZE, CascadeRule(True, 4),
                              IndexPack(), decodes_in_place=True)
    assert any(c.merges for c in lone_prefill)  # a prefill chunk would gather its run: splitting it off still pays


def test_consecutive_blocks_are_read_in_place_and_scattered_ones_gathered():
    chunks = queries_of([[8, 9, 10, 11, 20], [8, 9, 10, 11, 21]], [16, 16], [1, 1])
    _, calls = shared_calls(chunks, ALWAYS_CASCADE)
    assert [c.keys for c in calls] == [KeySource.GATHER, KeySource.VIEW]  # two decodes padded together; the run
    lone = queries_of([[3, 4, 5]], [9], [1])
    _, calls = shared_calls(lone, NO_CASCADE)
    assert [(c.keys, c.blocks) for c in calls] == [(KeySource.VIEW, range(3, 6))]


def test_decodes_read_in_place_list_their_blocks_and_mask_fields_padded_with_their_first():
    # Two forks over a shared run of 2 blocks: each keeps its private [20] / [21, 22]; a lone decode keeps all.
    chunks = queries_of([[8, 9, 20], [8, 9, 21, 22], [5, 3, 7]], [9, 13, 10], [1, 1, 1])
    pack = IndexPack()
    calls = plan_group(chunks, None, BLOCK_SIZE, CascadeRule(True, 1), pack, decodes_in_place=True)
    packed = pack.to(torch.device("cpu"))
    assert [c.keys for c in calls] == [KeySource.PAGED, KeySource.VIEW]
    assert rows_of(calls[0].rows, packed) == [0, 1, 2]
    call = calls[0].realize(packed, BLOCK_SIZE, None, torch.float32)
    assert call.num_keys == 3 * BLOCK_SIZE and call.bias is None
    assert call.blocks.tolist() == [[20, 20, 20], [21, 22, 21], [5, 3, 7]]
    # [query position, valid slots, logical blocks]: 9 is slot 1 of logical 2; 13 slot 1 of logical 3
    assert call.fields.tolist() == [[9, 2, 2, 2, 2], [13, 6, 2, 3, 2], [10, 11, 0, 1, 2]]


def test_a_block_the_chunk_still_writes_is_never_shared():
    # Both read block 3 (logical 1), but the second chunk's queries start inside it: only logical 0 is shared.
    chunks = queries_of([[7, 3, 20], [7, 3, 21]], [9, 6], [1, 2])
    assert shared_calls(chunks, ALWAYS_CASCADE)[0] == [([0, 1, 2], [7])]


def test_with_a_window_only_blocks_inside_every_query_window_are_shared():
    # Window 6: decodes at 13 see [8, 13]; block 1 ([4, 8)) is partly outside, block 2 ([8, 12)) inside.
    chunks = queries_of([[5, 6, 7, 20], [5, 6, 7, 21]], [13, 13], [1, 1])
    assert shared_calls(chunks, ALWAYS_CASCADE, window=6)[0] == [([0, 1], [7])]


# ---------------------------------------------------------------------------------------------- runner
@pytest.mark.parametrize(("name", "override"), SCENARIO_MODELS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenario=scenarios())
def test_cascade_matches_the_plain_path_and_the_reference(runners, name, override, scenario):
    plain, cascade, reference = runners[name, override]
    families, sequences, sliding_offset = scenario
    want = run_scenario(plain, families, sequences, sliding_offset)
    got = run_scenario(cascade, families, sequences, sliding_offset)
    assert (got - want).abs().max().item() < ATOL_PLAIN
    with torch.inference_mode():
        for row, seq in zip(got, sequences):
            ids = torch.tensor([seq["context"] + seq["new"]])
            expected = reference.model(input_ids=ids, use_cache=False).logits[0, -1].float()
            assert (row - expected).abs().max().item() < ATOL_REFERENCE
            assert int(row.argmax()) == int(expected.argmax())


def test_forks_decoding_together_take_the_shared_path(make_model, monkeypatch):
    """The runner hands its rule to the planner: forks of one parent get one merging (shared) call."""
    import engine.runner.model_runner as model_runner

    runner = ModelRunner(make_model("tiny-llama"), NUM_BLOCKS, BLOCK_SIZE, cascade=CascadeRule(True, 1))
    rng = random.Random(5)
    prefix, parent = tokens(16, rng), [10, 11, 12, 13]
    runner.execute([SeqChunk.of_table(prefix, 0, parent)])
    merging_calls = []

    def counting_plan(*args, **kwargs):
        calls = plan_group(*args, **kwargs)
        merging_calls.append(sum(c.merges for c in calls))
        return calls

    monkeypatch.setattr(model_runner, "plan_group", counting_plan)
    runner.execute([SeqChunk.of_table(tokens(1, rng), 16, parent + [20 + i]) for i in range(3)])
    assert merging_calls == [1]


@pytest.mark.parametrize("override", [None, "hybrid:5"])
def test_forks_and_prefix_hits_through_the_engine_match_the_reference(tmp_path, make_model, monkeypatch, override):
    """The scheduler's real tables (forks after copy-on-write, prefix hits, a sliding group) take the shared path."""
    import engine.runner.model_runner as model_runner
    from engine.core.config import EngineConfig
    from engine.engine import Engine
    from engine.core.request import SamplingParams
    from tests.engine_reference import LogitSpy, assert_matches_reference

    engine = Engine(EngineConfig(model="tiny-llama", device="cpu", block_size=4, num_blocks=96, data_dir=tmp_path,
                                 attention_override=override))
    engine.runner.cascade = ALWAYS_CASCADE
    spy = LogitSpy(engine)
    merging_calls = []

    def counting_plan(*args, **kwargs):
        calls = plan_group(*args, **kwargs)
        merging_calls.append(sum(c.merges for c in calls))
        return calls

    monkeypatch.setattr(model_runner, "plan_group", counting_plan)
    rng = random.Random(11)
    greedy = SamplingParams(max_new_tokens=5, ignore_eos=True)
    parent = engine.submit(tokens(30, rng), SamplingParams(max_new_tokens=1, ignore_eos=True), retain=True)
    engine.run_until_idle()
    children = [engine.fork(parent, tokens(n, rng), greedy) for n in (1, 3, 6)]
    hits = [engine.submit(list(engine.get(parent).prompt_token_ids[:24]) + tokens(n, rng), greedy) for n in (2, 9)]
    engine.run_until_idle()
    assert sum(merging_calls) > 0
    reference = make_model("tiny-llama", attention_override=override)
    for rid in (parent, *children, *hits):
        assert_matches_reference(engine, spy, reference, rid)
    engine.check_invariants()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_bf16_runner_stays_within_the_stated_tolerance_of_bf16_transformers(test_data_dir, name):
    """bf16 keeps 8 bits of mantissa: logits within 0.05 of transformers in bf16 (benchmarks/cuda_check.py)."""
    from engine.runner.model_loading import load_model

    def load():
        return load_model(EngineConfig(model=name, dtype="bfloat16", device="cpu", data_dir=test_data_dir))

    runner, reference = ModelRunner(load(), NUM_BLOCKS, BLOCK_SIZE, cascade=ALWAYS_CASCADE), load()
    assert runner.kv[0].dtype == torch.bfloat16
    rng = random.Random(3)
    prefix, parent = tokens(16, rng), [10, 11, 12, 13]
    runner.execute([SeqChunk.of_table(prefix, 0, parent)])
    suffixes = [tokens(n, rng) for n in (1, 1, 6)]
    logits = runner.execute([SeqChunk.of_table(s, 16, parent + [20 + 2 * i, 21 + 2 * i]) for i, s in enumerate(suffixes)])
    with torch.inference_mode():
        for row, suffix in zip(logits, suffixes):
            want = reference.model(input_ids=torch.tensor([prefix + suffix]), use_cache=False).logits[0, -1].float()
            assert (row - want).abs().max().item() < 0.05
