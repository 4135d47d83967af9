"""KV memory arithmetic (engine/core/kv_memory.py), with figures worked out by hand."""

from __future__ import annotations

import pytest

from engine.core.kv_memory import (
    DEFAULT_NUM_BLOCKS,
    MACHINE_MEMORY_SHARE,
    check_pool_fits,
    kv_bytes_per_block,
    pool_bytes,
    pool_num_blocks,
)

MIB = 2**20


def test_a_block_costs_k_and_v_for_every_layer_slot_head_and_dimension():
    # 2 (K, V) x 2 layers x 4 slots x 2 heads x 16 dims x 2 bytes = 1,024 bytes
    assert kv_bytes_per_block(2, 2, 16, "float16", 4) == 1024
    assert kv_bytes_per_block(2, 2, 16, "float32", 4) == 2048
    with pytest.raises(ValueError, match="dtype must be one of"):
        kv_bytes_per_block(2, 2, 16, "int8", 4)


def test_a_pool_is_sized_by_its_block_count_else_by_its_memory_budget_else_by_default():
    assert pool_num_blocks(64, None, 1024) == 64
    assert pool_num_blocks(None, 1, 1024) == 1024  # 1 MiB / 1 KiB
    assert pool_num_blocks(None, 1, 400_000) == 2  # 1,048,576 // 400,000: the partial third block is not given
    assert pool_num_blocks(None, None, 1024) == DEFAULT_NUM_BLOCKS == 1024


def test_a_memory_budget_below_one_block_is_refused():
    assert pool_num_blocks(None, 2, 2 * MIB) == 1
    with pytest.raises(ValueError, match="kv_memory_mb=1 holds less than one block"):
        pool_num_blocks(None, 1, 2 * MIB)


def test_a_pool_is_refused_above_its_share_of_the_machine_and_accepted_at_it():
    assert MACHINE_MEMORY_SHARE == 0.8
    assert pool_bytes(1000, MIB) == 1000 * MIB
    check_pool_fits(1000, MIB, 1250 * MIB)  # 1,000 MiB is exactly 0.8 of 1,250 MiB
    with pytest.raises(ValueError, match=r"a pool of 1,000 blocks needs about 1\.0 GiB .* this machine has 1\.2 GiB"):
        check_pool_fits(1000, MIB, 1249 * MIB)


def test_an_unknown_machine_size_refuses_nothing():
    check_pool_fits(10**9, MIB, None)
