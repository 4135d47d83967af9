"""Random-weight model directories for benchmarks: a transformers config in, config.json + safetensors out.

The engine loads any local model directory, so a benchmark on a model shape nobody downloaded (SmolLM2's
attention with a shrunk MLP, Llama-3.2-1B's shape) writes one from a config into a temporary directory
and loads it like a real checkpoint. Weights are drawn from a seed on the given device (fast on a GPU),
in the given dtype; no network is touched.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

# Llama-3.2-1B's shape (from its published config.json); the weights here are random.
LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    bos_token_id=128000,
    eos_token_id=128001,
)

# SmolLM2-135M's attention (30 layers, 9 query heads over 3 KV heads of 64) with the MLP and vocabulary
# shrunk, so that a step's time is mostly attention.
SMOLLM2_ATTENTION = dict(
    hidden_size=576,
    intermediate_size=64,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=512,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def write_random_model(
    shape: dict, directory: Path, *, dtype: torch.dtype, device: str = "cpu", seed: int = 0, **overrides
) -> Path:
    """Write a Llama model of `shape` (plus `overrides`) with seeded random weights into `directory`."""
    config = LlamaConfig(**{**shape, **overrides})
    with torch.random.fork_rng(devices=[] if device == "cpu" else None), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    del model
    return directory
