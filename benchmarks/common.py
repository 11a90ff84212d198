"""Shared pieces of the benchmarks: model shapes, workloads, timing, greedy tokens compared,
and result files."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astream.models.loader import default_model_path  # noqa: E402

if TYPE_CHECKING:
    from astream.base.outputs import StreamToken
    from astream.base.sampling import SamplingParams
    from astream.core.engine_core import EngineCore

RESULTS = ROOT / "benchmarks" / "results"

# Qwen3 model shapes (random weights: speed does not depend on the values).
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "micro": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True),
}


def shaped_model(shape: str, max_positions: int = 40960, root: Path | None = None,
                 vocab_size: int = 151936) -> Path:
    """A folder with a config.json of `shape`; load it with load_format="dummy"."""
    name = f"astream-{shape}-{max_positions}" + ("" if vocab_size == 151936 else f"-v{vocab_size}")
    folder = (root or Path(os.environ.get("TMPDIR", "/tmp"))) / name
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(model_type="qwen3", vocab_size=vocab_size,
                  head_dim=32 if shape in ("tiny", "micro") else 128,
                  max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=1e6,
                  bos_token_id=151643, eos_token_id=151645, **SHAPES[shape])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def smollm2() -> str:
    """The embedded model: its installed package, or the copy the device recipe stages."""
    staged = Path("/tmp/smollm2.gguf")
    if staged.is_file():
        return str(staged)
    return str(default_model_path())


def synthetic_tokenizer(vocab_size: int = 151936, root: Path | None = None) -> str:
    """A tokenizer folder built here, with no file to stage: token i is the word "t<i>",
    for benchmarks whose prompts are token ids and whose weights are random (a device
    command then carries nothing beyond the repository)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    folder = (root or Path(os.environ.get("TMPDIR", "/tmp"))) / f"astream-tokenizer-{vocab_size}"
    if not (folder / "tokenizer_config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        vocab = {f"t{i}": i for i in range(vocab_size)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t151643",
             "eos_token": "t151645"}))
    return str(folder)


def random_workload(n: int, lo: int, hi: int, out_lo: int, out_hi: int, seed: int = 0,
                    vocab: int = 49152) -> list[tuple[list[int], int]]:
    """n requests of (prompt token ids, output length), lengths uniform in the ranges."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    outs = torch.randint(out_lo, out_hi + 1, (n,), generator=gen).tolist()
    return [(torch.randint(100, vocab, (length,), generator=gen).tolist(), out)
            for length, out in zip(lens, outs)]


def run_requests(core: EngineCore, tag: str, prompts: list[list[int]],
                 params: list[SamplingParams]) -> list[list[StreamToken]]:
    """Each request's tokens (StreamTokens, the final marker left out)."""
    sinks = [core.add_request(f"{tag}-{i}", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
    while not all(sink.tokens and sink.tokens[-1].finish_reason for sink in sinks):
        core.step()
    return [[t for t in sink.tokens if t.token_id >= 0] for sink in sinks]


def top2_margins(tokens: list[StreamToken]) -> list[float]:
    """Each token's top-2 logprob margin (tokens of a request that asked for 2 or more)."""
    return [t.top_logprobs[0][1] - t.top_logprobs[1][1] for t in tokens]


def agreement(reference: list[list[int]], margins: list[list[float]], got: list[list[int]],
              tie: float) -> dict:
    """Rows identical, and where one parts from the reference: the step and the reference's
    top-2 margin there (a part within `tie` is a near tie, not an error)."""
    parts = []
    for row, (want, have) in enumerate(zip(reference, got)):
        step = next((i for i, (x, y) in enumerate(zip(want, have)) if x != y), None)
        if step is None and len(want) != len(have):
            step = min(len(want), len(have))
        if step is not None:
            margin = margins[row][step] if step < len(margins[row]) else float("inf")
            parts.append({"row": row, "step": step, "margin": round(margin, 4)})
    return {"identical": len(reference) - len(parts), "parts": parts,
            "ok": all(p["margin"] <= tie for p in parts)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    def __enter__(self) -> "Timer":
        sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync()
        self.seconds = time.perf_counter() - self.start


def cuda_times_ms(fn, reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of fn, timed with CUDA events after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def save(name: str, result: dict, smoke: bool = False) -> None:
    """Write benchmarks/results/<name>.json, and $OUT/<name>.json on the device machine.
    A smoke run (CPU, tiny shapes: it only checks the script) writes to /tmp instead."""
    result = {"device": device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), **result}
    text = json.dumps(result, indent=2, default=str)
    folder = Path("/tmp/astream-smoke") if smoke else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}.json").write_text(text)
    print(f"wrote {name}.json")


@contextmanager
def engine_core(config) -> Iterator:
    """An EngineCore for `config`, closed on the way out. Its device memory goes back to
    the driver when the next engine_core() starts, so every engine of a run sizes its
    cache from a clean device; the caller's `as` name holds it until then (a loop must
    `del` that name before its next engine)."""
    from astream.core.engine_core import EngineCore
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    core = EngineCore.create(config)
    try:
        yield core
    finally:
        core.runner.graphs = None
        core.close()
