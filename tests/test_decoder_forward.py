"""The Llama-family forward written over the weights (engine/runner/decoder_forward.py) against the same
model run through transformers' modules, on the same paged blocks and plans.

Each scenario runs one runner on the decoder forward and one on transformers' modules (fresh copies of the
same seeded weights) through identical `execute` calls: a prefix prefilled in two chunks, a mixed batch
(a cold prompt, a chunk continuing the prefix), then forks decoding over the shared prefix with cascade
attention. fp32 logits agree to 1e-5 with the same greedy tokens (they differ only in the fused linears'
summation order); bf16 logits to a few bf16 steps. Models the forward does not know run through
transformers' modules and still match the reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GemmaConfig, GemmaForCausalLM

from engine.core.config import EngineConfig
from engine.runner.attention_plan import ALWAYS_CASCADE
from engine.runner.decoder_forward import DecoderForward, FusedLinear, unsupported_reason
from engine.runner.model_loading import _describe, load_model
from engine.runner.model_runner import GroupSlots, ModelRunner, SeqChunk
from engine.runner.packed_linear import linear_kernels
from tests.engine_support import RUNNER_BLOCK_SIZE as BLOCK_SIZE
from tests.engine_support import RUNNER_NUM_BLOCKS as NUM_BLOCKS
from tests.engine_support import tokens

ARCHITECTURES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]


def chunk(runner: ModelRunner, token_ids: list[int], start: int, table: list[int]) -> SeqChunk:
    return SeqChunk(token_ids, start, tuple(GroupSlots(table, 0, start) for _ in runner.groups))


def scenario(runner: ModelRunner) -> list[torch.Tensor]:
    """The logits of every call of the scenario in the module docstring."""
    prefix = tokens(2 * BLOCK_SIZE + 3, 1)
    shared = list(range(3))
    results = [
        runner.execute([chunk(runner, prefix[:5], 0, shared)]),
        runner.execute([chunk(runner, prefix[5:], 5, shared)]),
        runner.execute([chunk(runner, tokens(9, 2), 0, [10, 11, 13]), chunk(runner, tokens(4, 3), len(prefix), shared + [12])]),
    ]
    forks = [[20 + i, 30 + i] for i in range(3)]
    for i, table in enumerate(forks):  # each fork's private blocks after the two full shared ones
        runner.copy_blocks([[(shared[2], table[0], 3)]])
        results.append(runner.execute([chunk(runner, tokens(2, 4 + i), len(prefix), shared[:2] + table)]))
    position = len(prefix) + 2
    for step in range(3):
        results.append(runner.execute([chunk(runner, tokens(1, 10 * step + i), position + step, shared[:2] + table)
                                       for i, table in enumerate(forks)]))
    return results


@pytest.mark.parametrize("fused_steps", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_decoder_forward_computes_what_transformers_modules_compute(tmp_path, name, dtype, fused_steps):
    runners = [
        ModelRunner(load_model(EngineConfig(model=name, device="cpu", dtype=dtype, data_dir=tmp_path)),
                    NUM_BLOCKS, BLOCK_SIZE, cascade=ALWAYS_CASCADE, decoder_forward=decoder)
        for decoder in (True, False)
    ]
    kernels = linear_kernels(torch.device("cpu"), getattr(torch, dtype))
    assert kernels.startswith("panels up to ") and ", oneDNN above" in kernels
    assert runners[0].forward_path == f"decoder, fused CPU ops, linears: {kernels}"
    assert runners[0].decoder is not None
    assert runners[1].forward_path.startswith("transformers") and runners[1].decoder is None
    if not fused_steps:  # the steps every other device runs
        runners[0].decoder = DecoderForward(runners[0].loaded.model, runners[0].loaded.device, runners[0].loaded.dtype,
                                            fused_steps=False)
        assert (runners[0].decoder.steps.fused, runners[0].decoder.steps.name) == ((), "torch ops")
    for ours, theirs in zip(*(scenario(runner) for runner in runners)):
        if dtype == "float32":
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
            assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
        else:  # both in bf16: a few units of bf16's 8-bit mantissa at the logits' scale
            assert (ours - theirs).abs().max().item() <= 4 * 2**-8 * max(1.0, theirs.abs().max().item())


def tiny_gemma() -> nn.Module:
    config = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    return GemmaForCausalLM(config).eval().requires_grad_(False)


def test_a_model_type_it_does_not_know_runs_through_transformers_modules_and_matches_the_reference():
    model = tiny_gemma()  # Gemma: RMSNorm scales by 1 + weight and the embeddings by sqrt(hidden)
    assert "model type 'gemma'" in unsupported_reason(model)
    runner = ModelRunner(_describe(model, None, "tiny-gemma", "seed-0", torch.device("cpu")), NUM_BLOCKS, BLOCK_SIZE)
    assert runner.decoder is None and runner.forward_path.startswith("transformers (model type 'gemma'")
    context = tokens(19, 5)
    runner.execute([chunk(runner, context[:-4], 0, [3, 4, 5, 6, 7])])
    logits = runner.execute([chunk(runner, context[-4:], len(context) - 4, [3, 4, 5, 6, 7])])
    want = tiny_gemma()(input_ids=torch.tensor([context]), use_cache=False).logits[0, -1].float()
    torch.testing.assert_close(logits[0], want, rtol=0, atol=1e-4)


def test_unsupported_layouts_are_named():
    model = load_model(EngineConfig(model="tiny-llama", device="cpu")).model
    assert unsupported_reason(model) is None
    model.config.hidden_act = "gelu"
    assert "activation 'gelu'" in unsupported_reason(model)
    model.config.hidden_act = "silu"
    model.model.layers[1].mlp.up_proj = nn.Identity()
    assert "not plain linear layers" in unsupported_reason(model)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linears_return_each_groups_outputs_side_by_side(packed, dtype):
    torch.manual_seed(1)
    linears = [nn.Linear(24, out, bias=bias).to(dtype) for out, bias in ((16, True), (8, False), (40, True))]
    fused = FusedLinear([linears[:2], linears[2:]], packed=packed)
    for rows in (1, 7):
        x = torch.randn(rows, 24).to(dtype)
        want = [torch.cat([F_linear(x, linears[0]), F_linear(x, linears[1])], dim=-1), F_linear(x, linears[2])]
        got = fused(x)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            if packed and dtype == torch.float32:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # oneDNN's summation order
            else:
                assert torch.equal(g, w)


def F_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    return torch.nn.functional.linear(x, linear.weight, linear.bias)
