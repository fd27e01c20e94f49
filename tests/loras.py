"""LoRA adapters for tests: built with peft on the tiny model, random non-zero weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    return _greedy(model, prompt, n)


def write_lora(
    model_path: Path | str,
    out: Path,
    seed: int,
    *,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
) -> Path:
    """A LoRA adapter in PEFT's format written without peft (vLLM's venv has none): random
    A and B for every `targets` Linear, alpha 2·rank."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=generator) * 0.3
            b = torch.randn(module.out_features, rank, generator=generator) * 0.3
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_path),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged_greedy(
    model_path: Path | str, adapter: Path | None, prompt: list[int], n: int
) -> list[int]:
    """Greedy tokens of the model with the adapter merged into its weights by hand
    (W + alpha/r · B @ A): LoRA's maths, with no LoRA library."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / config["r"]
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        modules = dict(model.named_modules())
        with torch.no_grad():
            for key, a in weights.items():
                if key.endswith(".lora_A.weight"):
                    name = key.removesuffix(".lora_A.weight")
                    b = weights[name + ".lora_B.weight"]
                    linear = modules[name.removeprefix("base_model.model.")]
                    assert isinstance(linear, torch.nn.Linear)
                    linear.weight += scale * (b @ a)
    return _greedy(model, prompt, n)


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` (EOS ignored) from a transformers model."""
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
