"""Tiny random LoRA adapters built offline, for the embedded chat model (or any Llama-shaped one).

An adapter is what PEFT saves: ``adapter_config.json`` and ``adapter_model.safetensors`` holding
``lora_A`` (rank x input) and ``lora_B`` (output x rank) for each targeted projection of each
layer. PEFT starts ``lora_B`` at zero, which would leave the model unchanged; here both are
random, so an adapter visibly changes what the model generates while staying a valid adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def build_tiny_lora_adapter(
    folder: Path,
    base: Path,
    *,
    seed: int = 0,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    scale: float = 0.1,
    **config: Any,
) -> Path:
    """A random LoRA adapter of ``rank`` on ``targets`` of the Llama-shaped model in ``base``
    (its ``config.json`` gives the shapes); ``config`` adds or overrides adapter_config.json fields."""
    import torch
    from safetensors.torch import save_file

    model = json.loads((base / "config.json").read_text(encoding="utf-8"))
    hidden = model["hidden_size"]
    head_dim = model.get("head_dim") or hidden // model["num_attention_heads"]
    outputs = {
        "q_proj": model["num_attention_heads"] * head_dim,
        "k_proj": model["num_key_value_heads"] * head_dim,
        "v_proj": model["num_key_value_heads"] * head_dim,
        "o_proj": hidden,
    }
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(model["num_hidden_layers"]):
        for target in targets:
            stem = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            inputs = hidden if target != "o_proj" else model["num_attention_heads"] * head_dim
            weights[f"{stem}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) * scale
            weights[f"{stem}.lora_B.weight"] = torch.randn(outputs[target], rank, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        **config,
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder
