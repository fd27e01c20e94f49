"""Builds a small random-weight Llama-style model and a locally trained BPE tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TINY_MODEL_NAME = "tiny-llama"
# Bump when the recipe changes so stale caches are rebuilt instead of silently reused.
TINY_RECIPE_VERSION = 1
_STAMP = "tokenyard-tiny.json"
_SEED = 1234
VOCAB_SIZE = 1024

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The `tiny-tools` variant's template: tools and calls as Hermes and Qwen 2.5 write them (the
# tools in the system turn inside <tools></tools>, calls as <tool_call>{..}</tool_call>, results
# as <tool_response>), so a gateway's tool_call_parser `auto` reads its calls as hermes.
TOOLS_CHAT_TEMPLATE = (
    # transformers renders with trim_blocks: a newline right after a tag is dropped, so those
    # are written {{ nl }}
    "{% set nl = '\\n' %}{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' "
    "else none %}"
    "{% if tools %}"
    "<|system|>\n{% if system %}{{ system }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|end|>\n'
    "{% elif system is not none %}<|system|>\n{{ system }}<|end|>{{ nl }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}"
    "<|assistant|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    '<tool_call>\n{"name": {{ call[\'name\'] | tojson }}, "arguments": '
    "{{ call['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|end|>{{ nl }}"
    "{% elif message['role'] == 'tool' %}"
    "<|user|>\n<tool_response>\n{{ message['content'] }}\n</tool_response><|end|>{{ nl }}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>{{ nl }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ nl }}{% endif %}"
)

# The `tiny-reasoning` variant's: the tools template with a reasoning model's parts, as Qwen3
# writes them: an assistant turn's reasoning as <think>..</think> before its text, thinking
# turned off (`enable_thinking` false) closed in the prompt, and `reasoning_effort` shown in a
# system turn (as gpt-oss's template shows it). <think> and </think> are tokens of their own.
THINK_TOKENS = ("<think>", "</think>")
REASONING_CHAT_TEMPLATE = (
    TOOLS_CHAT_TEMPLATE.replace(
        "{{ bos_token }}",
        "{{ bos_token }}{% if reasoning_effort is defined and reasoning_effort %}"
        "<|system|>\nReasoning: {{ reasoning_effort }}<|end|>{{ nl }}{% endif %}",
        1,
    )
    .replace(
        "<|assistant|>\n{{ message['content'] or '' }}",
        "<|assistant|>\n{% if message['reasoning_content'] %}"
        "<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{% endif %}"
        "{{ message['content'] or '' }}",
    )
    .replace(
        "{% if add_generation_prompt %}<|assistant|>{{ nl }}{% endif %}",
        "{% if add_generation_prompt %}<|assistant|>{{ nl }}"
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>{{ nl }}{{ nl }}</think>{{ nl }}{{ nl }}{% endif %}{% endif %}",
    )
)

# A small fixed corpus: English prose, code, numbers and some multi-byte UTF-8 so that
# byte-level tokens split characters (which the incremental detokenizer must handle).
_CORPUS = """
The queue holds every request until a worker has a free slot. A worker claims a job, runs
it through the engine, streams the tokens back and then acknowledges the job. If the worker
dies, the lease expires and another worker picks the job up again, continuing from the
tokens that were already streamed, so the client sees one uninterrupted answer.
Continuous batching lets new sequences join the running batch as soon as others finish.
Static batching waits until the batch is full or a timer fires, and then runs the whole
batch to the end. Long prompts use more of the token budget than short ones.
Once upon a time there was a small model that wanted to write poems about the sea, the
mountains, the rivers and the stars. It wrote one line every day and read it every night.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i, add(i, 1))

class Queue:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

{"model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 0.0}
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 32 64 128 256 512 1024 2048 4096
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April
Le café est très chaud. Où est la bibliothèque? Ça va très bien, merci beaucoup.
Der Bär läuft über die Straße. Schöne Grüße aus München. Größe, Übung, Äpfel.
El niño comió una manzana. ¿Dónde está la estación? Mañana será otro día.
Привет, как дела? Я люблю читать книги. Москва, Санкт-Петербург, Новосибирск.
你好，世界。今天天气很好。我们一起去吃饭吧。机器学习和人工智能。
こんにちは世界。ありがとうございます。東京と大阪と京都。
안녕하세요. 감사합니다. 서울은 아름다운 도시입니다.
Emoji: 🚀 🎉 😀 👍 🔥 ✨ — “quotes” and ‘apostrophes’ … €100, £50, ¥1000, ±3°C, π ≈ 3.14159.
"""  # noqa: RUF001


def default_cache_dir() -> Path:
    """Directory under which tiny models are cached (`TOKENYARD_CACHE_DIR` overrides)."""
    env = os.environ.get("TOKENYARD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tokenyard"


def _stamp(head_dim: int | None = None, template: str | None = None) -> dict[str, object]:
    stamp: dict[str, object] = {
        "name": TINY_MODEL_NAME,
        "recipe": TINY_RECIPE_VERSION,
        "seed": _SEED,
    }
    if head_dim is not None:
        stamp["head_dim"] = head_dim
    if template is not None:
        stamp["chat_template"] = template
    return stamp


def _is_built(path: Path, head_dim: int | None = None, template: str | None = None) -> bool:
    try:
        return bool(json.loads((path / _STAMP).read_text()) == _stamp(head_dim, template))
    except (OSError, ValueError):
        return False


def ensure_tiny_model(
    path: str | os.PathLike[str] | None = None,
    *,
    head_dim: int | None = None,
    tools: bool = False,
    reasoning: bool = False,
) -> Path:
    """Return the tiny model directory, building it once (atomically) if it is missing.

    `head_dim` builds a variant with wider attention heads (same tokenizer): vLLM's CPU
    attention has kernels for head sizes 32 and up, not the default model's 16. `tools`
    builds `tiny-tools`: the same weights and vocabulary, with a chat template that shows
    tools and tool calls as Hermes does (TOOLS_CHAT_TEMPLATE). `reasoning` builds
    `tiny-reasoning`: its vocabulary has <think> and </think> too (so other weights), and its
    template is a reasoning model's (REASONING_CHAT_TEMPLATE, tools included).
    """
    template = "reasoning" if reasoning else "tools" if tools else None
    name = TINY_MODEL_NAME if head_dim is None else f"{TINY_MODEL_NAME}-hd{head_dim}"
    name += f"-{template}" if template else ""
    target = Path(path).expanduser() if path is not None else default_cache_dir() / name
    if _is_built(target, head_dim, template):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        text = {"tools": TOOLS_CHAT_TEMPLATE, "reasoning": REASONING_CHAT_TEMPLATE}
        _build(tmp, head_dim, template, text.get(template or ""))
        if target.exists() and not _is_built(target, head_dim, template):
            # A stale or half-written directory from an older recipe: replace it.
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race; its build is identical (same seed and corpus).
            if not _is_built(target, head_dim, template):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tokenizer() -> PreTrainedTokenizerFast:
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    return train_tokenizer(lines, VOCAB_SIZE, min_frequency=1)


def train_tokenizer(
    lines: Iterable[str], vocab_size: int, min_frequency: int
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `lines`, with the tiny model's special tokens and
    chat template (also what bench/gpu/make_model.py's larger random models use)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD, BOS, EOS, *_ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(_ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def _build(
    out: Path,
    head_dim: int | None = None,
    template: str | None = None,
    chat_template: str | None = None,
) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if template == "reasoning":
        # not special: decoding keeps them in the text, where a reasoning parser reads them
        tokenizer.add_tokens(list(THINK_TOKENS))
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # None keeps hidden_size // num_attention_heads (16)
        head_dim=head_dim,
        max_position_embeddings=2048,
        # A larger init spread makes the random model's logits peaky, so greedy decoding
        # is far from numerical ties and identical across attention implementations.
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The stamp is written last: a directory without it is never considered built.
    (out / _STAMP).write_text(json.dumps(_stamp(head_dim, template)))
