"""What a capacity costs to buy (analysis/purchase.py), against figures worked by hand for SmolLM2-135M
(30 layers, 3 KV heads, head size 64) and a Llama-3-8B-shaped model (32 layers, 8 KV heads, head size 128),
both in bfloat16."""

from __future__ import annotations

import pytest

from analysis.purchase import GIB, Accelerator, ModelShape, kv_room, purchase

SMOLLM2_135M = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2, weight_bytes=270_000_000)
LLAMA3_8B = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2, weight_bytes=16_060_000_000)


def test_kv_bytes_per_token_is_two_times_layers_heads_head_size_and_dtype_bytes():
    assert SMOLLM2_135M.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072  # 128 KiB


def test_smollm2_needs_two_small_accelerators_for_a_million_tokens():
    card = Accelerator(memory_gib=24, usable_share=0.9, price_per_hour=1.2)
    # 24 GiB × 0.9 = 23,192,823,398 bytes usable (rounded down), less 270,000,000 of weights.
    assert kv_room(SMOLLM2_135M, card) == 22_922_823_398
    bought = purchase(1_000_000, SMOLLM2_135M, card)
    assert bought.kv_bytes == 23_040_000_000  # 21.46 GiB: just over one card's room
    assert bought.kv_gib == pytest.approx(21.4577, abs=1e-4)
    assert bought.accelerators == 2 and bought.price_per_hour == pytest.approx(2.4)


def test_llama3_8b_needs_three_80_gib_accelerators_for_a_million_tokens():
    card = Accelerator(memory_gib=80, usable_share=0.9, price_per_hour=4.0)
    # 72 GiB = 77,309,411,328 bytes usable, less 16,060,000,000 of weights: 61,249,411,328 for KV.
    assert kv_room(LLAMA3_8B, card) == 61_249_411_328
    bought = purchase(1_000_000, LLAMA3_8B, card)
    assert bought.kv_bytes == 131_072_000_000 and bought.kv_gib == pytest.approx(122.0703, abs=1e-4)
    assert bought.accelerators == 3 and bought.price_per_hour == 12.0  # 2.14 cards' worth, rounded up
    assert purchase(467_000, LLAMA3_8B, card).accelerators == 1  # 61,210,624,000 bytes: fits one


def test_a_cache_of_any_size_needs_at_least_one_accelerator_to_serve_it():
    card = Accelerator(memory_gib=80, usable_share=0.9, price_per_hour=4.0)
    assert purchase(0, LLAMA3_8B, card).accelerators == 1


def test_weights_that_fill_the_usable_memory_are_refused_with_both_sizes():
    with pytest.raises(ValueError, match=r"the weights \(15.0 GiB\) fill the usable 14.4 GiB of a 16 GiB accelerator"):
        purchase(1, LLAMA3_8B, Accelerator(memory_gib=16, usable_share=0.9, price_per_hour=1.0))


def test_impossible_shapes_and_offers_are_refused():
    with pytest.raises(ValueError, match="num kv heads must be at least 1"):
        ModelShape(num_layers=1, num_kv_heads=0, head_dim=64, dtype_bytes=2, weight_bytes=0)
    with pytest.raises(ValueError, match="usable share must be in"):
        Accelerator(memory_gib=80, usable_share=1.5, price_per_hour=1.0)
    assert GIB == 1 << 30
