"""The peers' copies of SmolLM2-135M for benchmarks/peer_cpu.py, made once from the project's safetensors.

Into `<data dir>/peer-cpu/` (the data directory of engine.core.config.default_data_dir):

- `smollm2-135m-instruct-f32.gguf` and `-bf16.gguf`: llama.cpp's own `convert_hf_to_gguf.py` (from the
  llama.cpp source in `.venv-llamacpp/src`, run by that environment's interpreter) over the safetensors
  folder this engine loads, `--outtype f32` and `--outtype bf16`;
- `openvino-fp32/`: optimum-intel's `optimum-cli export openvino --weight-format fp32` over the same
  folder, with its tokenizer and detokenizer models (the pipeline loads them even when fed token ids).
  One IR serves both dtypes: optimum-intel has no bf16 weight format, and OpenVINO's bf16 is the
  runtime's `INFERENCE_PRECISION_HINT`.

Each is written under a temporary name and renamed when complete, so a file or folder that exists is
whole; nothing that exists is made again. Run with the project's interpreter (`make peer-cpu` does).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
OPTIMUM_CLI = ROOT / ".venv-openvino" / "bin" / "optimum-cli"
GGUF_NAMES = {"float32": "smollm2-135m-instruct-f32.gguf", "bfloat16": "smollm2-135m-instruct-bf16.gguf"}
OPENVINO_NAME = "openvino-fp32"


def llamacpp_converter() -> Path:
    """convert_hf_to_gguf.py from the llama.cpp source the Makefile unpacked (exactly one version there)."""
    found = sorted((ROOT / ".venv-llamacpp" / "src").glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one llama.cpp source under .venv-llamacpp/src, found {len(found)}")
    return found[0]


def converter_input(safetensors_dir: Path, folder: Path) -> None:
    """The safetensors folder as the converter's transformers can read it, in `folder` (links, one file rewritten).

    transformers 5 (this project's) names the tokenizer class `TokenizersBackend`, which the transformers
    release llama.cpp's converter pins does not know; `PreTrainedTokenizerFast` reads the same tokenizer.json.
    """
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(safetensors_dir / name)
    tokenizer_config = json.loads((safetensors_dir / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def make_gguf(safetensors_dir: Path, target: Path, outtype: str) -> None:
    staging = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="peer-cpu-hf-") as folder:
        converter_input(safetensors_dir, Path(folder))
        subprocess.run(
            [str(LLAMACPP_PYTHON), str(llamacpp_converter()), folder, "--outtype", outtype, "--outfile", str(staging)],
            check=True,
        )
    staging.rename(target)


def make_openvino(safetensors_dir: Path, target: Path) -> None:
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    subprocess.run(
        [str(OPTIMUM_CLI), "export", "openvino", "--model", str(safetensors_dir), "--task", "text-generation-with-past",
         "--weight-format", "fp32", str(staging)],
        check=True,
    )
    staging.rename(target)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from engine.core.config import default_data_dir
    from engine.runner.model_loading import ensure_smollm2_converted

    data_dir = default_data_dir()
    safetensors_dir = ensure_smollm2_converted(data_dir)
    peer_dir = data_dir / "peer-cpu"
    peer_dir.mkdir(parents=True, exist_ok=True)
    for dtype, name in GGUF_NAMES.items():
        if not (peer_dir / name).exists():
            make_gguf(safetensors_dir, peer_dir / name, {"float32": "f32", "bfloat16": "bf16"}[dtype])
    if not (peer_dir / OPENVINO_NAME).exists():
        make_openvino(safetensors_dir, peer_dir / OPENVINO_NAME)
    print(f"peer models in {peer_dir}")


if __name__ == "__main__":
    main()
