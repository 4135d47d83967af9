"""One resident CPU engine answering benchmark commands over a pipe: this engine, vLLM, llama.cpp or OpenVINO.

Started by benchmarks/peer_cpu.py, once per engine and dtype, with the interpreter of that engine's own
virtual environment (`.venv`, `.venv-vllm`, `.venv-llamacpp`, `.venv-openvino`). The protocol is
benchmarks/peer_vllm_worker.py's (one JSON command per line on stdin, one JSON reply per line; a ready
line first), and so are this engine's and vLLM's drivers, imported from there. The two added here:

- llama.cpp: its `llama-server` (built by `make peer-cpu` from the llama.cpp source that the
  llama-cpp-python sdist vendors), started by this worker and driven over HTTP (`/completion` with the
  prompt as token ids, one concurrent request per prompt). The server is what operators run (ollama and
  LM Studio embed the same slot scheduler), not the Python binding: the binding's `Llama` runs one
  sequence at a time, so its batches would be a sum of single requests. Settings, from the server's
  README for throughput: one slot per concurrent request (`--parallel 64`, the most any cell submits) over
  one unified KV buffer (`--kv-unified`, 1,152 tokens per slot), continuous batching and `cache_prompt`
  (both on by default), its host-RAM prompt cache at its default 8 GiB, `--threads 2 --threads-batch 2`,
  batch 2,048 / micro-batch 512 (the defaults), flash attention `auto`; the KV cache in the model's own
  type (f32 or bf16, not the default f16) so that fp32 outputs can match.
- OpenVINO GenAI: `ContinuousBatchingPipeline` over the IR that optimum-intel exported from the same
  safetensors, with `enable_prefix_caching`, dynamic split-fuse (its default), 64 sequences and 2,048
  batched tokens a step, `INFERENCE_NUM_THREADS` 2, `INFERENCE_PRECISION_HINT` and `KV_CACHE_PRECISION`
  set to the dtype (its CPU default KV cache is u8, which would change fp32 outputs); on a CPU without
  bf16 instructions both are f32 (its paged attention refuses a bf16 KV cache there).

Every engine decodes greedily with EOS ignored from the same token ids. "reset" empties what each engine
lets a client empty: this engine's and vLLM's prefix caches, llama-server's slots (`action=erase`; its
host-RAM prompt cache stays, and holds only other prompts since every cell draws new ones); OpenVINO's
pipeline has no call for it, so its reset is a no-op (its cold cells are cold because their prompts are new).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from peer_vllm_worker import Backend, ThisEngine, VllmEngine, serve

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / ".venv-llamacpp" / "bin" / "llama-server"
MAX_REQUESTS = 64  # the most prompts any cell submits at once
MAX_CONTEXT = 1152  # tokens per request: the 1,056-token prompt and 64 new ones, rounded up


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """llama.cpp's `llama-server` as a child process, one HTTP request per prompt, all sent at once."""

    def __init__(self, model_path: str, dtype: str, threads: int) -> None:
        cache_type = {"float32": "f32", "bfloat16": "bf16"}[dtype]
        self.port = _free_port()
        self.slot_dir = tempfile.TemporaryDirectory(prefix="peer-cpu-slots-")  # slot actions need one; none saved
        self.server = subprocess.Popen(
            [
                str(LLAMA_SERVER), "--model", model_path, "--host", "127.0.0.1", "--port", str(self.port),
                "--threads", str(threads), "--threads-batch", str(threads),
                "--parallel", str(MAX_REQUESTS), "--kv-unified", "--ctx-size", str(MAX_REQUESTS * MAX_CONTEXT),
                "--cache-type-k", cache_type, "--cache-type-v", cache_type, "--no-webui",
                "--slot-save-path", self.slot_dir.name,
            ],
            stdout=sys.stderr,
            stderr=sys.stderr,
        )
        self.pool = ThreadPoolExecutor(max_workers=MAX_REQUESTS)
        self._wait_healthy(timeout_s=300.0)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"llama-server exited with status {self.server.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy")

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def _complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        reply = self._post("/completion", {
            "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": True, "return_tokens": True, "stream": False,
        })
        return list(reply["tokens"])

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        futures = [self.pool.submit(self._complete, prompt, max_tokens) for prompt in prompts]
        return [future.result() for future in futures]

    def reset(self) -> None:
        for slot in range(MAX_REQUESTS):
            self._post(f"/slots/{slot}?action=erase", {})

    def close(self) -> None:
        self.pool.shutdown()
        self.server.terminate()
        self.server.wait(timeout=30)
        self.slot_dir.cleanup()


class OpenVinoPipeline:
    """OpenVINO GenAI's continuous-batching pipeline with prefix caching, fed token ids."""

    def __init__(self, model_dir: str, dtype: str, threads: int) -> None:
        import numpy
        import openvino
        import openvino_genai

        precision = {"float32": "f32", "bfloat16": "bf16"}[dtype]
        if "BF16" not in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
            precision = "f32"  # its paged attention takes only an f32 KV cache there, and its bf16 hint reads f32
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = True
        scheduler.cache_size = 2  # GB of KV blocks: far more than any cell needs
        scheduler.max_num_seqs = MAX_REQUESTS
        scheduler.max_num_batched_tokens = 2048
        self.pipeline = openvino_genai.ContinuousBatchingPipeline(model_dir, scheduler, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision,
        })
        self._tensor = lambda prompt: openvino.Tensor(numpy.asarray([prompt], dtype=numpy.int64))
        self._config = openvino_genai.GenerationConfig

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        config = self._config()
        config.max_new_tokens = max_tokens
        config.ignore_eos = True
        config.do_sample = False
        results = self.pipeline.generate([self._tensor(prompt) for prompt in prompts], [config] * len(prompts))
        return [list(result.m_generation_ids[0]) for result in results]

    def reset(self) -> None:
        """No call empties the pipeline's prefix cache; every cell draws new prompts instead."""


BACKENDS: dict[str, Callable[[argparse.Namespace], Backend]] = {
    "this": lambda args: ThisEngine(args.model_dir, args.dtype, args.block_size),
    "vllm": lambda args: VllmEngine(args.model_dir, args.dtype, args.block_size),
    "llamacpp": lambda args: LlamaServer(args.model_dir, args.dtype, args.threads),
    "openvino": lambda args: OpenVinoPipeline(args.model_dir, args.dtype, args.threads),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=sorted(BACKENDS), required=True)
    parser.add_argument("--model-dir", required=True, help="safetensors folder, GGUF file or OpenVINO IR folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever an engine (or a process it starts) prints lands on stderr
    sys.stdout = sys.stderr
    if args.engine in ("this", "vllm"):
        import torch

        torch.set_num_threads(args.threads)
    backend = BACKENDS[args.engine](args)
    replies.write(json.dumps({"ready": True, "engine": args.engine, "threads": args.threads}) + "\n")
    try:
        serve(backend, replies)
    finally:
        if isinstance(backend, LlamaServer):
            backend.close()


if __name__ == "__main__":
    main()
