"""Shared fixtures: the embedded SmolLM2 model, tiny random Qwen2/Qwen3 folders, engines."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from astream.models.loader import DEFAULT_MODEL_FILE, DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_PACKAGE


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist each worker gets its share of the cores: torch's intra-op threads
    # from two workers on two cores would contend and make both slower than one.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))

PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        pytest.fail(f"the embedded model is missing; install it with: {DEFAULT_MODEL_INSTALL}")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from astream.models.gguf_tokenizer import load_gguf_tokenizer
    return load_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' AutoTokenizer on the embedded file (about 5 s: built once)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def smol_llm():
    """One fp32 CPU engine on the embedded model, shared by the read-only tests."""
    from astream import LLM
    return LLM(device="cpu", dtype="float32", num_kv_blocks=1024, max_model_len=2048)


def _tiny_model(tmp_root: Path, arch: str, tokenizer) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed({"qwen2": 2, "qwen3": 3}[arch])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # random init is tiny; make the logits spread so argmax is stable
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.normal_(0, 0.2)
    folder = tmp_root / f"tiny-{arch}"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, smollm2_tokenizer) -> Path:
    return _tiny_model(tmp_path_factory.mktemp("models"), "qwen3", smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, smollm2_tokenizer) -> Path:
    return _tiny_model(tmp_path_factory.mktemp("models"), "qwen2", smollm2_tokenizer)


# ---- the websocket server tests (tests/test_server_*.py) --------------------------------------

@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def server():
    """One engine and server per test module, on a free loopback port."""
    from astream import Engine
    from astream.server import ServerOptions, StreamServer
    from server_helpers import ENGINE_KW, OPTIONS

    async with Engine(**ENGINE_KW) as engine:
        async with StreamServer(engine, ServerOptions(**OPTIONS)) as srv:
            yield srv


@pytest.fixture(scope="module")
async def idle_free(server):
    from server_helpers import health

    return (await health(server.port))["kv_blocks_free"]
