"""Builds a random-weight Llama (about 1.1 B parameters: TinyLlama's shape) and a locally
trained byte-level BPE tokenizer, saved as safetensors for the GPU benchmarks.

Nothing is downloaded: the tokenizer learns its merges from the benchmark's own prompt words
and seeded pseudo-words, so a 32000-entry vocabulary is real and every id decodes.

    python -m bench.gpu.make_model --out /tmp/ty-1b [--size 1b|tiny] [--device cuda]
        [--dtype bfloat16] [--layers N] [--hidden N] [--intermediate N] [--vocab N]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenyard.bench.workload import WORDS
from tokenyard.engines import tiny

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SEED = 1234

# Llama shapes. "1b" is TinyLlama-1.1B's (GQA: 32 query heads, 4 KV heads of 64); "tiny" is for
# checking the plumbing on a CPU in seconds.
SIZES: dict[str, dict[str, int]] = {
    "1b": {
        "hidden": 2048,
        "layers": 22,
        "heads": 32,
        "kv_heads": 4,
        "intermediate": 5632,
        "vocab": 32000,
    },
    "tiny": {
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 192,
        "vocab": 2048,
    },
}


def corpus(seed: int) -> list[str]:
    """Lines to train on: the workload's prompt words (so a prompt word is about one token) and
    pseudo-words from syllables, enough distinct ones to fill a 32000-entry vocabulary."""
    rng = random.Random(seed)
    syllables = [c + v + t for c in "bcdfghjklmnprstvwz" for v in "aeiou" for t in ("", "n")]
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(2, 4))) for _ in range(70_000)})
    lines: list[str] = []
    for _ in range(3):  # each pseudo-word three times: past min_frequency, in varied company
        rng.shuffle(words)
        lines += [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)]
    lines += [" ".join(rng.choices(WORDS, k=20)) for _ in range(6000)]
    return lines


def train_tokenizer(vocab_size: int, seed: int = SEED) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `vocab_size` entries with tokenyard's tiny specials."""
    return tiny.train_tokenizer(corpus(seed), vocab_size, min_frequency=2)


def build(opts: argparse.Namespace) -> dict[str, Any]:
    """Tokenizer, config and random weights into `opts.out`; returns what was built."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    shape = {**SIZES[opts.size]}
    for key in shape:
        if getattr(opts, key) is not None:
            shape[key] = getattr(opts, key)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape["vocab"])
    tokenizer_s = time.perf_counter() - start
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # every row of the embedding is a token the tokenizer has
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    torch.manual_seed(opts.seed)
    # Initialised where it will run: a 1 B model's random init takes seconds on a GPU, not a
    # minute of CPU; and in the target dtype, so no float32 copy is ever made.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype[opts.dtype])
    try:
        with torch.device(opts.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    )
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)  # safetensors
    tokenizer.save_pretrained(out)
    del model
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {
        "path": str(out),
        "size": opts.size,
        "shape": {**shape, "vocab": len(tokenizer)},
        "dtype": opts.dtype,
        "parameters": params,
        "weight_bytes": weights,
        "tokenizer_s": round(tokenizer_s, 2),
        "build_s": round(time.perf_counter() - start, 2),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory to write the model into")
    p.add_argument("--size", choices=sorted(SIZES), default="1b")
    p.add_argument("--device", default="cpu", help="where to initialise the weights")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--seed", type=int, default=SEED)
    for key in SIZES["1b"]:
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(build(parse(argv))))


if __name__ == "__main__":
    main()
