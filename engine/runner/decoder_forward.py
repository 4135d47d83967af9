"""A Llama-family decoder's forward written out over its weights: what the runner runs instead of
transformers' modules for the model types it knows (Llama, Mistral, Qwen2, Qwen3).

Those four share one block: pre-norm RMSNorm, rotary attention (q/k/v biases optional, Qwen3 adds a
per-head RMSNorm on queries and keys) and a SiLU-gated MLP::

    h = embed(tokens)
    every layer:  x = rms_norm(h);  q|k|v = x W_qkv (+ b);  q, k = rope(q, k);  h = h + attention(q, k, v) W_o
                  x = rms_norm(h);  g|u = x W_gate_up;  h = h + (silu(g) * u) W_down
    logits = rms_norm(h[rows]) W_lm_head

The last layer writes every token's K/V, but from there on only `rows` reach the LM head: its attention
runs for their queries alone, its W_o and MLP for their rows alone. In a prefill of 64 requests x 32
tokens over a cached 1,024-token prefix (SmolLM2, fp32, 2 threads) that is 64 rows of the last layer
instead of 2,048, and the step took 2.87-2.94 s instead of 2.99-3.04.

Run through transformers' modules, a one-row decode step of SmolLM2 spent about 13 ms of its 47 in module
calls, keyword plumbing and small tensor ops around the linears and the attention kernels. Here a layer is
a short run of tensor ops: q/k/v and gate/up are each one linear over one weight (packed once on the CPU,
engine/runner/packed_linear.py), the rotary embedding of queries and keys is one set of
elementwise ops over both.

What it computes is transformers' own arithmetic: the same formulas in the same dtype (RMSNorm in float32,
cast back, then scaled by its weight), cos/sin from the model's own rotary module (so every rope scaling
type transformers supports), the same weights. Results equal transformers' up to the summation order of
the fused linears. Any other model type, activation or layer layout runs through transformers' modules
instead; `unsupported_reason` says why.

The elementwise steps between the linears (residual add and RMSNorm, SiLU-and-multiply, the rotary
embedding) run as torch ops or, on the CPU, as one op each of the engine's library where that op's probe
passed on the model's dtype and heads (engine/runner/layer_steps.py, `layer_steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.runner.kernel_probes import ProbeCase
from engine.runner.layer_steps import FUSED_STEPS, LayerSteps, rms_norm
from engine.runner.native_kernels import passing_ops, probe_notes
from engine.runner.packed_linear import pack_weight, packed_linear, packs_linears

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# (layer index, queries [T, heads, head_dim], keys [T, kv_heads, head_dim], values like keys, softmax scale,
#  last tokens only) -> attention output [T, heads, head_dim]; writes the layer's new K/V into the cache
#  first. With last tokens only, the output need be set only at each chunk's last token (the `rows` of
#  `DecoderForward.__call__`: the runner's chunks end there).
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float, bool], torch.Tensor]


class FusedLinear:
    """Linears over the same input computed as one, in groups: `__call__` returns one output per group (a
    group's linears' outputs side by side).

    On the CPU (fp32/bf16 with oneDNN) every weight is concatenated and packed once, so a call reads one
    weight; elsewhere each linear keeps its own weight (no copy in device memory) and runs `F.linear`.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Linear]], packed: bool) -> None:
        self.groups = [list(group) for group in groups]
        self.sizes = [sum(linear.out_features for linear in group) for group in self.groups]
        self.packed = packed
        if packed:
            linears = [linear for group in self.groups for linear in group]
            self.weight = pack_weight(torch.cat([linear.weight for linear in linears]))
            self.bias = None if all(linear.bias is None for linear in linears) else torch.cat(
                [linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias for linear in linears]
            )

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.packed:
            out = packed_linear(x, self.weight, self.bias)
            return list(out.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [out]
        outputs = [[F.linear(x, linear.weight, linear.bias) for linear in group] for group in self.groups]
        return [parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1) for parts in outputs]


def layer_steps(device: torch.device, case: ProbeCase, fused: bool = True) -> LayerSteps:
    """Each step as the library's op where it can run (a CPU device, its probe passed on `case`), else as
    torch ops; the notes say why a step is not fused.

    Raises:
        StaleKernelLibraryError: on the CPU, the kernel library is stale (engine/runner/native_kernels.py).
    """
    if not fused or device.type != "cpu":
        return LayerSteps({})
    return LayerSteps(passing_ops(FUSED_STEPS, case), probe_notes(FUSED_STEPS, case))


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: Qwen3's per-head q and k norm weights
    qk_norm_eps: float
    qkv: FusedLinear  # -> queries and keys side by side, values
    o: FusedLinear
    gate_up: FusedLinear
    down: FusedLinear
    scaling: float


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `DecoderForward` cannot run this model (None when it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    if type(getattr(model, "lm_head", None)) is not nn.Linear:
        return "the LM head is not a plain linear layer"
    for index, layer in enumerate(inner.layers):
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(linear) is not nn.Linear for linear in linears):
            return f"layer {index}: its projections are not plain linear layers"
        if not all(hasattr(getattr(layer, n, None), "variance_epsilon") for n in ("input_layernorm", "post_attention_layernorm")):
            return f"layer {index}: its input or post-attention norm is not an RMSNorm"
    return None


class DecoderForward:
    """The forward of one Llama-family model over its weights (see the module docstring).

    Holds references to the model's weights and, on the CPU, packed copies of its linears (the model
    itself stays usable, e.g. for the reference forward).
    """

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, *, fused_steps: bool = True) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"DecoderForward cannot run this model: {reason}")
        packed = packs_linears(device, dtype)
        inner = model.model
        config = model.config
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(inner.layers[0].self_attn.head_dim)
        self.steps = layer_steps(device, ProbeCase(dtype, self.num_heads, self.num_kv_heads, self.head_dim), fused_steps)
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.lm_head = FusedLinear([[model.lm_head]], packed)
        self.layers = tuple(self._layer(layer, packed) for layer in inner.layers)

    def _layer(self, layer: nn.Module, packed: bool) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        qk_norm = None
        if q_norm is not None and k_norm is not None:
            dim = q_norm.weight.shape[0]
            qk_norm = torch.cat([q_norm.weight.expand(self.num_heads, dim), k_norm.weight.expand(self.num_kv_heads, dim)])
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            eps=float(layer.input_layernorm.variance_epsilon),
            qk_norm=qk_norm,
            qk_norm_eps=float(q_norm.variance_epsilon) if q_norm is not None else 0.0,
            # queries and keys as one output: they get the same rotary ops
            qkv=FusedLinear([[attention.q_proj, attention.k_proj], [attention.v_proj]], packed),
            o=FusedLinear([[attention.o_proj]], packed),
            gate_up=FusedLinear(
                [[mlp.gate_proj, mlp.up_proj]] if self.steps.joined_gate_up else [[mlp.gate_proj], [mlp.up_proj]], packed
            ),
            down=FusedLinear([[mlp.down_proj]], packed),
            scaling=float(attention.scaling),
        )

    def __call__(
        self, token_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """Logits of the tokens at `rows`.

        Args:
            token_ids: [T] the packed tokens of the step.
            positions: [T] each token's position in its sequence.
            rows: [R] indices into the T tokens whose logits are wanted.
            attention: the paged attention of one layer (see `Attention`).

        Returns:
            [R, vocab_size] logits in the model's dtype.
        """
        num_tokens, heads, kv_heads, head_dim = token_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        steps = self.steps
        hidden = F.embedding(token_ids, self.embed)
        cos, sin = self.rotary(hidden.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        x = steps.norm(hidden, self.layers[0].input_norm, self.layers[0].eps)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            qk, values = layer.qkv(x)
            qk = qk.view(num_tokens, heads + kv_heads, head_dim)
            if layer.qk_norm is not None:
                qk = rms_norm(qk, layer.qk_norm, layer.qk_norm_eps)
            qk = steps.rope(qk, cos, sin)
            values = values.view(num_tokens, kv_heads, head_dim)
            # the last layer writes every token's K/V; past them only the LM head's rows matter
            attended = attention(index, qk[:, :heads], qk[:, heads:], values, layer.scaling, index == last and rows.numel() < num_tokens)
            if index == last:
                attended, hidden = attended[rows], hidden[rows]
            (out,) = layer.o(attended.reshape(attended.shape[0], heads * head_dim))
            hidden, x = steps.add_norm(hidden, out, layer.post_norm, layer.eps)
            (out,) = layer.down(steps.silu_and_mul(layer.gate_up(x)))
            if index < last:  # the next layer's input norm, over hidden + out
                following = self.layers[index + 1]
                hidden, x = steps.add_norm(hidden, out, following.input_norm, following.eps)
            else:
                hidden = hidden + out
        (logits,) = self.lm_head(rms_norm(hidden, self.norm, self.norm_eps))
        return logits

