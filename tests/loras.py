"""LoRA adapters for tests: built with peft on the tiny model, random non-zero weights."""

from __future__ import annotations

from pathlib import Path

import torch


def build_lora(
    model_path: Path | str,
    out: Path,
    seed: int,
    *,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
) -> Path:
    """A PEFT LoRA adapter saved at `out`: A and B drawn at random (PEFT's default leaves B
    zero, an adapter that changes nothing), large enough to change greedy output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False
    )
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    peft_model.save_pretrained(str(out))
    return out


def peft_greedy(
    model_path: Path | str, adapter: Path | None, prompt: list[int], n: int
) -> list[int]:
    """PEFT's own `generate` with the adapter (None: the base alone), greedy, EOS ignored."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return list(out[0, len(prompt) :].tolist())
