"""ModelRunner against the transformers reference on the same weights (fp32, CPU, tiny models).

The reference is an independently loaded copy of the model run as a plain full forward with its own
SDPA attention and no cache. Every scenario checks last-position logits within 1e-4 and equal greedy
tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.runner.attention_plan import ALWAYS_CASCADE, NO_CASCADE
from engine.core.config import EngineConfig
from engine.core.kv_memory import kv_bytes_per_block
from engine.runner.model_runner import GroupSlots, ModelRunner, SeqChunk
from engine.runner.model_loading import load_model
from engine.runner.packed_linear import PackedLinear, packs_linears
from tests.engine_support import RUNNER_BLOCK_SIZE as BLOCK_SIZE
from tests.engine_support import RUNNER_NUM_BLOCKS as NUM_BLOCKS
from tests.engine_support import tokens

ATOL = 1e-4
ARCHITECTURES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


def shuffled_blocks(seed: int) -> list[int]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


@torch.inference_mode()
def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of a full forward: row i predicts the token after token_ids[i]."""
    return reference.model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()


def chunk(runner: ModelRunner, token_ids: list[int], start: int, table: list[int]) -> SeqChunk:
    """A chunk whose table (from block 0) is the same in every KV group's memory."""
    return SeqChunk(token_ids, start, tuple(GroupSlots(table, 0, start) for _ in runner.groups))


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().max().item() < ATOL
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_cold_prompt_in_one_chunk_matches_reference(runner_pair, name):
    runner, reference = runner_pair(name)
    prompt = tokens(13, 1)
    logits = runner.execute([chunk(runner, prompt, 0, shuffled_blocks(1))])
    assert logits.shape == (1, reference.vocab_size) and logits.dtype == torch.float32
    assert_close(logits[0], reference_logits(reference, prompt)[-1])


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_prompt_prefilled_in_several_chunks_matches_reference(runner_pair, name):
    runner, reference = runner_pair(name)
    prompt, table = tokens(23, 2), shuffled_blocks(2)
    want = reference_logits(reference, prompt)
    for start, end in [(0, 5), (5, 6), (6, 16), (16, 23)]:  # unaligned, single-token, aligned boundaries
        logits = runner.execute([chunk(runner, prompt[start:end], start, table)])
        assert_close(logits[0], want[end - 1])


def test_suffix_reads_prefix_blocks_shared_from_another_sequence(runner_pair):
    runner, reference = runner_pair("tiny-llama")
    prefix, blocks = tokens(16, 3), shuffled_blocks(3)
    runner.execute([chunk(runner, prefix, 0, blocks[:4])])
    suffix = tokens(7, 4)
    other_table = blocks[:4] + blocks[10:12]  # shares the four full prefix blocks, then its own
    logits = runner.execute([chunk(runner, suffix, 16, other_table)])
    assert_close(logits[0], reference_logits(reference, prefix + suffix)[-1])


def test_greedy_generation_by_decode_steps_matches_reference(runner_pair):
    runner, reference = runner_pair("tiny-qwen3")
    context, table = tokens(9, 5), shuffled_blocks(5)
    logits = runner.execute([chunk(runner, context, 0, table)])
    for _ in range(8):
        context.append(int(logits[0].argmax()))
        logits = runner.execute([chunk(runner, context[-1:], len(context) - 1, table)])
    assert_close(logits[0], reference_logits(reference, context)[-1])
    greedy = [int(row.argmax()) for row in reference_logits(reference, context)[8:-1]]
    assert greedy == context[9:]


def test_copy_blocks_then_both_copies_continue_independently(runner_pair):
    runner, reference = runner_pair("tiny-llama")
    shared, blocks = tokens(10, 6), shuffled_blocks(6)  # 2 full blocks + 2 slots of a third
    parent_table = blocks[:3]
    runner.execute([chunk(runner, shared, 0, parent_table)])
    child_table = blocks[:2] + [blocks[20]]
    runner.copy_blocks([[(parent_table[2], child_table[2], 2)]])
    parent_next, child_next = tokens(3, 7), tokens(3, 8)
    child_logits = runner.execute([chunk(runner, child_next, 10, child_table + [blocks[21]])])
    parent_logits = runner.execute([chunk(runner, parent_next, 10, parent_table + [blocks[3]])])
    assert_close(child_logits[0], reference_logits(reference, shared + child_next)[-1])
    assert_close(parent_logits[0], reference_logits(reference, shared + parent_next)[-1])


def test_mixed_batch_of_prefills_and_a_decode_in_one_call(runner_pair):
    runner, reference = runner_pair("tiny-qwen2")
    blocks = shuffled_blocks(9)
    cached = tokens(11, 10)
    runner.execute([chunk(runner, cached, 0, blocks[:3])])
    decoding = tokens(6, 11)
    runner.execute([chunk(runner, decoding[:5], 0, blocks[3:5])])
    cold, continued = tokens(9, 12), tokens(6, 13)
    logits = runner.execute(
        [
            chunk(runner, cold, 0, blocks[5:8]),
            chunk(runner, decoding[5:], 5, blocks[3:5]),
            chunk(runner, continued, 11, blocks[:3] + blocks[8:10]),
        ]
    )
    assert logits.shape[0] == 3
    assert_close(logits[0], reference_logits(reference, cold)[-1])
    assert_close(logits[1], reference_logits(reference, decoding)[-1])
    assert_close(logits[2], reference_logits(reference, cached + continued)[-1])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_several_decodes_of_different_lengths_batch_together(runner_pair, name):
    runner, reference = runner_pair(name)
    blocks = shuffled_blocks(14)
    contexts = [tokens(n, 20 + n) for n in (3, 14, 8)]
    tables = [blocks[0:1], blocks[1:5], blocks[5:7]]
    for context, table in zip(contexts, tables):
        runner.execute([chunk(runner, context[:-1], 0, table)])
    logits = runner.execute([chunk(runner, c[-1:], len(c) - 1, t) for c, t in zip(contexts, tables)])
    for row, context in zip(logits, contexts):
        assert_close(row, reference_logits(reference, context)[-1])


@pytest.mark.parametrize(("name", "override"), [("tiny-mistral", None), ("tiny-llama", "hybrid:5")])
def test_sliding_window_context_beyond_window_matches_reference(runner_pair, name, override):
    runner, reference = runner_pair(name, override)
    assert any(kind.startswith("sliding:") for kind in runner.loaded.attention_spec)
    context, table = tokens(30, 15), shuffled_blocks(15)
    want = reference_logits(reference, context)
    for start, end in [(0, 11), (11, 12), (12, 25), (25, 26), (26, 30)]:
        logits = runner.execute([chunk(runner, context[start:end], start, table)])
        assert_close(logits[0], want[end - 1])


def test_all_sliding_model_never_reads_blocks_before_the_window(runner_pair):
    runner, reference = runner_pair("tiny-mistral")  # window 8
    context, table = tokens(28, 16), shuffled_blocks(16)
    runner.execute([chunk(runner, context[:24], 0, table)])
    runner.kv[0][:, :, :, table[40]] = float("nan")  # any read of this block would poison the logits
    scrubbed = [table[40]] * 4 + table[4:7]  # positions 0..15 now point at it
    logits = runner.execute([chunk(runner, context[24:], 24, scrubbed)])
    assert_close(logits[0], reference_logits(reference, context)[-1])


def test_sliding_override_differs_from_full_attention_beyond_the_window(runner_pair):
    runner, _ = runner_pair("tiny-llama", "sliding:4")
    _, full_reference = runner_pair("tiny-llama")
    context = tokens(12, 17)
    logits = runner.execute([chunk(runner, context, 0, shuffled_blocks(17))])
    assert (logits[0] - reference_logits(full_reference, context)[-1]).abs().max().item() > ATOL


def test_bytes_per_block_matches_the_allocation(make_model):
    loaded = make_model("tiny-llama")
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    allocated = sum(kv.numel() * kv.element_size() for kv in runner.kv)
    assert ModelRunner.bytes_per_block(loaded, BLOCK_SIZE) * (NUM_BLOCKS + 1) == allocated  # + scratch block


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_torch_free_kv_estimate_is_what_a_runner_allocates(tmp_path, dtype):
    loaded = load_model(EngineConfig(model="tiny-qwen3", device="cpu", dtype=dtype, data_dir=tmp_path))
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    allocated = sum(kv.numel() * kv.element_size() for kv in runner.kv)
    estimate = kv_bytes_per_block(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, dtype, BLOCK_SIZE)
    assert estimate * (NUM_BLOCKS + 1) == allocated


@pytest.mark.parametrize(
    "chunk_args",
    [
        ([], 0, [0]),
        ([5], -1, [0]),
        ([5] * 5, 0, [0]),  # table too short for 5 positions
        ([5], 0, [NUM_BLOCKS]),  # block id out of range
    ],
)
def test_malformed_chunks_are_refused(runner_pair, chunk_args):
    runner, _ = runner_pair("tiny-llama")
    with pytest.raises(ValueError):
        runner.execute([SeqChunk.of_table(*chunk_args)])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_a_nan_in_a_block_no_chunk_holds_never_reaches_a_padded_decode_batch(runner_pair, name):
    """Regression: decode batches padded their gathers with block 0, masked yet multiplied by zero
    weights, so a NaN another request of the same step wrote into block 0 made every shorter decode NaN.
    The padding is `engine/runner/attention_plan.py`'s `_gathered_call`: each element pads with its own first block."""
    runner, reference = runner_pair(name)
    blocks = [b for b in shuffled_blocks(14) if b != 0]
    contexts = [tokens(n, 20 + n) for n in (3, 14, 8)]
    tables = [blocks[0:1], blocks[1:5], blocks[5:7]]
    for context, table in zip(contexts, tables):
        runner.execute([chunk(runner, context[:-1], 0, table)])
    for kv in runner.kv:
        kv[:, :, :, 0] = float("nan")
    logits = runner.execute([chunk(runner, c[-1:], len(c) - 1, t) for c, t in zip(contexts, tables)])
    for row, context in zip(logits, contexts):
        assert_close(row, reference_logits(reference, context)[-1])



@pytest.mark.parametrize("cascade", [NO_CASCADE, ALWAYS_CASCADE], ids=["plain", "cascade"])
def test_a_nan_in_a_block_no_chunk_holds_never_reaches_forks_decoding_over_a_shared_prefix(runner_pair, cascade):
    """The same regression where cascade attention splits a decode batch: two forks read their shared
    prefix once, and their private tails (padded to the longest, with an unrelated decode) must not
    read block 0 either."""
    runner, reference = runner_pair("tiny-llama")
    runner.cascade = cascade
    blocks = [b for b in shuffled_blocks(15) if b != 0]
    prefix = tokens(8, 30)
    contexts = [prefix + tokens(1, 31), prefix + tokens(9, 32), tokens(6, 33)]
    shared = blocks[0:2]  # the prefix's two full blocks, in both forks' tables
    tables = [shared + blocks[2:3], shared + blocks[3:6], blocks[6:8]]
    runner.execute([chunk(runner, prefix, 0, tables[0]), chunk(runner, contexts[2][:-1], 0, tables[2])])
    runner.execute([chunk(runner, contexts[1][8:-1], 8, tables[1])])
    for kv in runner.kv:
        kv[:, :, :, 0] = float("nan")
    logits = runner.execute([chunk(runner, c[-1:], len(c) - 1, t) for c, t in zip(contexts, tables)])
    for row, context in zip(logits, contexts):
        assert_close(row, reference_logits(reference, context)[-1])
def test_clear_slots_zeroes_exactly_what_a_chunk_wrote(runner_pair):
    runner, _ = runner_pair("tiny-llama")
    kept, cleared = chunk(runner, tokens(6, 1), 0, [3, 4]), chunk(runner, tokens(5, 2), 0, [7, 8])
    runner.execute([kept, cleared])
    before = runner.kv[0].clone()
    runner.clear_slots(cleared)
    after = runner.kv[0]
    assert after[:, :, :, 7].eq(0).all() and after[:, :, :, 8, :1].eq(0).all()  # positions 0..4: block 7, slot 0 of 8
    assert before[:, :, :, 7].ne(0).any()  # they held K/V before
    after[:, :, :, 7:9] = before[:, :, :, 7:9]
    assert torch.equal(after, before)  # nothing else changed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_runner_packs_every_decoder_linear_and_the_lm_head_without_changing_what_they_compute(tmp_path, dtype):
    """On transformers' modules (the path of models the decoder forward does not know)."""
    loaded = load_model(EngineConfig(model="tiny-qwen2", device="cpu", dtype=dtype, data_dir=tmp_path))
    plain = {name: module.weight.clone() for name, module in loaded.model.named_modules()
             if isinstance(module, torch.nn.Linear) and (name.startswith("model.layers.") or name == "lm_head")}
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE, decoder_forward=False)
    if not packs_linears(torch.device("cpu"), loaded.dtype):
        assert runner.num_packed_linears == 0  # bf16 on a CPU without oneDNN's bf16 matmul: F.linear
        return
    packed = dict(loaded.model.named_modules())
    assert runner.num_packed_linears == len(plain) == 7 * loaded.num_layers + 1
    assert ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE, decoder_forward=False).num_packed_linears == 0  # already packed
    for name, weight in plain.items():
        module = packed[name]
        assert isinstance(module, PackedLinear)
        for rows in (1, 5):
            x = torch.randn(1, rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(weight.dtype)
            want = torch.nn.functional.linear(x, weight, module.bias)
            got = module(x)
            if dtype == "bfloat16":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_forwards_results_depend_on_its_thread_count_only_in_the_last_bits(tmp_path, dtype):
    """The thread governor (engine/runner/thread_governor.py) changes the count between steps; a cached
    prefix computed at two threads and a suffix at one give the logits of an all-two-thread run up to
    rounding (PyTorch's CPU flash kernel with a mask rounds differently at one thread for this model's
    16-wide heads; SmolLM2's linears and attention shapes measured bit-identical)."""
    loaded = load_model(EngineConfig(model="tiny-llama", device="cpu", dtype=dtype, data_dir=tmp_path))
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE)
    context = tokens(3 * BLOCK_SIZE + 5, 11)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in ((2, 2), (2, 1), (1, 2)):
            table = list(range(9, 9 + -(-len(context) // BLOCK_SIZE)))
            torch.set_num_threads(threads[0])
            runner.execute([chunk(runner, context[:-3], 0, table)])
            torch.set_num_threads(threads[1])
            results.append(runner.execute([chunk(runner, context[-3:], len(context) - 3, table)]))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-5)
