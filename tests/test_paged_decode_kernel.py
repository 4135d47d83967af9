"""The paged decode kernel (engine/runner/csrc/paged_decode.cpp) against attention over the same keys gathered
and masked (MATH), and its refusals. `make install` builds it; a CPU runner must use it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runner.attention_kernels import Kernel, attend, attend_decodes, choose_kernels
from engine.runner.native_kernels import load_ops, stale_reason

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 32, 4, 24


def gathered_reference(q, cache, blocks, fields, window):
    """MATH over each element's listed blocks gathered, with the mask the padded call builds."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        position, valid, logical = int(fields[b, 0]), int(fields[b, 1]), fields[b, 2:]
        key_pos = (logical[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
        visible = (torch.arange(key_pos.numel()) < valid) & (key_pos <= position)
        if window:
            visible &= key_pos > position - window
        bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).to(q.dtype)
        k, v = (c[:, blocks[b]].reshape(1, KV_HEADS, -1, HEAD_DIM) for c in cache)
        out, lse = attend(q[b : b + 1, :, None], k, v, scale=0.2, bias=bias.view(1, 1, 1, -1), kernel=Kernel.MATH)
        outs.append(out[0, :, 0])
        lses.append(lse[0, :, 0])
    return torch.stack(outs), torch.stack(lses)


@st.composite
def decode_batches(draw):
    """Elements over scattered blocks: each a logical run (a cascade's private part may skip a shared run),
    valid slots ending anywhere in its last block, padded to the longest with its own first block."""
    num_elements = draw(st.integers(1, 5))
    lengths = [draw(st.integers(1, 5)) for _ in range(num_elements)]
    width = max(lengths)
    blocks, fields = [], []
    for length in lengths:
        physical = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=length, max_size=length))
        first, skip = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        logical = [first] + [first + skip + 1 + i for i in range(length - 1)]
        valid = (length - 1) * BLOCK_SIZE + draw(st.integers(1, BLOCK_SIZE))
        position = logical[(valid - 1) // BLOCK_SIZE] * BLOCK_SIZE + (valid - 1) % BLOCK_SIZE  # the last valid key
        padding = width - length
        blocks.append(physical + [physical[0]] * padding)
        fields.append([position, valid, *logical, *[logical[0]] * padding])
    window = draw(st.sampled_from([0, 3, 7, 64]))
    return torch.tensor(blocks), torch.tensor(fields), window


def random_cache(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=60, deadline=None)
@given(batch=decode_batches(), seed=st.integers(0, 2**16))
def test_paged_decode_matches_math_over_the_gathered_keys(dtype, batch, seed):
    blocks, fields, window = batch
    cache = random_cache(dtype, seed)
    q = torch.randn(blocks.shape[0], HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out, lse = attend_decodes(q, cache[0], cache[1], blocks, fields, window=window or None, scale=0.2)
    want_out, want_lse = gathered_reference(q, cache, blocks, fields, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    assert (out.float() - want_out.float()).abs().max().item() <= tolerance
    assert (lse - want_lse).abs().max().item() <= 1e-5


def test_queries_are_read_through_their_strides():
    """The runner passes query rows as views (a head-major transpose on transformers' path)."""
    cache = random_cache(torch.float32)
    blocks, fields = torch.tensor([[3, 9], [4, 4]]), torch.tensor([[6, 7, 0, 1], [1, 2, 0, 0]])
    heads_first = torch.randn(HEADS, 2, HEAD_DIM)
    strided = heads_first.transpose(0, 1)
    assert not strided.is_contiguous()
    got, _ = attend_decodes(strided, cache[0], cache[1], blocks, fields, window=None, scale=0.2)
    want, _ = attend_decodes(strided.contiguous(), cache[0], cache[1], blocks, fields, window=None, scale=0.2)
    assert torch.equal(got, want)


def test_a_nan_in_a_block_no_element_reads_reaches_no_result():
    """Padding and slots past an element's valid ones are never read (a NaN there is another request's)."""
    cache = random_cache(torch.float32)
    cache[:, :, 5] = float("nan")  # block 5: padding of element 0, and past element 1's valid slots
    cache[:, :, 6, 3] = float("nan")  # slot 3 of block 6: after element 1's last valid slot
    blocks, fields = torch.tensor([[2, 5], [6, 1]]), torch.tensor([[2, 3, 0, 0], [2, 3, 0, 0]])
    q = torch.randn(2, HEADS, HEAD_DIM)
    out, lse = attend_decodes(q, cache[0], cache[1], blocks, fields, window=None, scale=0.2)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize(
    ("blocks", "fields", "message"),
    [
        ([[2, NUM_BLOCKS]], [[1, 2, 0, 1]], "outside the cache"),
        ([[2, -1]], [[1, 2, 0, 1]], "outside the cache"),
        ([[2, 3]], [[1, 2, 0]], "fields must be"),
        ([[2, 3]], [[9, 3 * BLOCK_SIZE, 0, 1]], "more valid slots"),
    ],
)
def test_bad_block_lists_are_refused_before_anything_is_read(blocks, fields, message):
    cache = random_cache(torch.float32)
    with pytest.raises(RuntimeError, match=message):
        attend_decodes(torch.randn(1, HEADS, HEAD_DIM), cache[0], cache[1], torch.tensor(blocks), torch.tensor(fields),
                       window=None, scale=0.2)


def test_the_kernel_is_built_and_a_cpu_runner_reads_decodes_in_place():
    """`make install` builds it: a CPU runner that fell back to padded decode batches would be a regression."""
    ops, why = load_ops()
    assert ops is not None, why
    for dtype in (torch.float32, torch.bfloat16):
        choice = choose_kernels(torch.device("cpu"), dtype, 9, 3, 64)
        assert (choice.decodes, choice.notes) == (Kernel.CPU_PAGED_DECODE, ())


def test_a_library_is_current_only_when_built_after_and_from_exactly_its_sources(tmp_path):
    """A source edited, added or deleted since the build makes the library stale (loading it then raises,
    tests/test_kernel_library.py)."""
    import os

    sources = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    library, manifest = tmp_path / "ops.so", tmp_path / "ops.sources"
    for path in sources:
        path.write_text("// source")
    library.write_bytes(b"")
    assert "other sources" in stale_reason(library, manifest, sources)  # no manifest
    manifest.write_text("a.cpp\nb.cpp\n")
    assert stale_reason(library, manifest, sources) is None
    assert "other sources" in stale_reason(library, manifest, sources[:1])  # b.cpp deleted since
    assert "other sources" in stale_reason(library, manifest, [*sources, tmp_path / "c.cpp"])  # c.cpp added
    os.utime(sources[0], (library.stat().st_mtime + 5, library.stat().st_mtime + 5))  # a.cpp edited after
    assert "older than its sources" in stale_reason(library, manifest, sources)
