"""Model loading: the converted SmolLM2 cache, seeded presets, attention specs and overrides."""

from __future__ import annotations

import time

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.kv_groups import attention_window
from engine.runner.model_runner import ModelRunner, SeqChunk
from engine.runner.model_loading import SMOLLM2_CACHE_NAME, ensure_atomic_dir, load_model, override_attention
from engine.runner.sampler import sample
from engine.core.request import SamplingParams


def test_smollm2_conversion_is_cached_and_runs_like_transformers_generate(smollm2_dir, test_data_dir):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat()
    started = time.perf_counter()
    config = EngineConfig(model="smollm2", device="cpu", data_dir=test_data_dir)
    loaded = load_model(config)
    load_seconds = time.perf_counter() - started
    reference = load_model(config)
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "the cache was rewritten"
    assert load_seconds < 10, f"a cached load took {load_seconds:.1f} s"
    assert loaded.weights_revision == reference.weights_revision
    assert not [p for p in smollm2_dir.parent.iterdir() if p.name.startswith(f".{SMOLLM2_CACHE_NAME}")]
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (30, 3, 64)
    assert loaded.attention_spec == ("full",) * 30 and 2 in loaded.eos_token_ids

    tokenizer = loaded.tokenizer
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        generated = reference.model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False)
    want = generated[0, len(prompt_ids) :].tolist()

    runner = ModelRunner(loaded, num_blocks=8, block_size=16)
    table, context, got = list(range(8))[::-1], list(prompt_ids), []
    split = len(context) // 2
    runner.execute([SeqChunk.of_table(context[:split], 0, table)])
    logits = runner.execute([SeqChunk.of_table(context[split:], split, table)])
    while len(got) < len(want):
        got.append(sample(logits, [SamplingParams()], [None])[0])
        context.append(got[-1])
        logits = runner.execute([SeqChunk.of_table(context[-1:], len(context) - 1, table)])
    assert got == want


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("tiny-llama", ("full",) * 4),
        ("tiny-mistral", ("sliding:8",) * 4),
        ("tiny-qwen2", ("full",) * 4),
        ("tiny-qwen3", ("full",) * 4),
    ],
)
def test_presets_report_their_shape_and_attention(make_model, name, spec):
    loaded = make_model(name)
    assert loaded.attention_spec == spec
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.vocab_size) == (4, 2, 16, 512)
    assert loaded.tokenizer is None and loaded.eos_token_ids == (2,)
    assert loaded.dtype == torch.float32 and not loaded.model.training


def test_presets_are_seeded_without_touching_the_global_rng(make_model):
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    first, again, other = make_model("tiny-llama"), make_model("tiny-llama"), make_model("tiny-llama", seed=1)
    assert torch.rand(1) == expected_draw
    first_weights = first.model.state_dict()
    assert all(torch.equal(first_weights[k], v) for k, v in again.model.state_dict().items())
    assert first.weights_revision == again.weights_revision != other.weights_revision


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_overrides_keep_the_weights_and_change_only_the_attention(make_model, name):
    base = make_model(name)
    hybrid = make_model(name, attention_override="hybrid:6")
    sliding = make_model(name, attention_override="sliding:6")
    assert hybrid.attention_spec == ("sliding:6", "full", "sliding:6", "full")
    assert sliding.attention_spec == ("sliding:6",) * 4
    base_weights = base.model.state_dict()
    for overridden in (hybrid, sliding):
        assert overridden.weights_revision == base.weights_revision
        assert all(torch.equal(base_weights[k], v) for k, v in overridden.model.state_dict().items())


def test_tiny_chat_has_the_smollm2_tokenizer(make_model):
    loaded = make_model("tiny-chat")
    assert loaded.vocab_size == len(loaded.tokenizer) == 49152
    assert loaded.tokenizer.chat_template


@pytest.mark.parametrize("bad", ["sliding", "sliding:0", "hybrid:x", "chunked:4"])
def test_malformed_overrides_are_refused(make_model, bad):
    with pytest.raises(ValueError):
        override_attention(make_model("tiny-llama").model.config, bad)


def test_attention_window_parses_attention_kinds():
    assert attention_window("full") is None and attention_window("sliding:4096") == 4096
    for bad in ("sliding:-1", "sliding:0", "sliding:", "chunked:4", "Full"):
        with pytest.raises(ValueError):
            attention_window(bad)


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        load_model(EngineConfig(model="no-such-model", device="cpu", data_dir=tmp_path))


def test_killed_conversion_leaves_no_partial_cache(tmp_path):
    target = tmp_path / "models" / "converted"

    def fill_then_die(staging):
        (staging / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_atomic_dir(target, fill_then_die)
    assert list(target.parent.iterdir()) == []
    ensure_atomic_dir(target, lambda staging: (staging / "config.json").write_text("{}"))
    assert (target / "config.json").read_text() == "{}"
