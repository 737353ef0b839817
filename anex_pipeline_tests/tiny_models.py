"""Tiny random models built offline, for tests that need a reasoning or tool-calling model format.

The weights are random, so the generated text is noise; what matters is that the tokenizer knows
every model family's special tokens (so vLLM's parsers find them in the vocabulary) and that the
chat template behaves like a thinking model's: it honours ``enable_thinking`` and renders
``tools``. A 2-layer Qwen3 with head_dim 64 (the CPU attention backend refuses smaller heads)
builds in a few seconds, and its weights load in vLLM at once (the engine's start-up dominates).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The special tokens of every family the parsers cover: ChatML (Qwen), DeepSeek, Kimi, GLM,
# MiniMax. GPT-OSS is absent on purpose: its harmony parser reads token ids of its own encoding.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<minimax:tool_call>",
    "</minimax:tool_call>",
]

TRAINING_LINES = [
    "Let me think about this step by step before I answer.",
    "The answer is 42. The capital of France is Paris.",
    'get_weather {"city": "London", "unit": "celsius"} function arguments name',
    "The weather in London is cloudy with a chance of rain today.",
    "Thinking budget exhausted; answering with what I have.",
]

# ChatML with a thinking switch: thinking is on unless enable_thinking is false. When it is on,
# the generation prompt opens the <think> block itself (as DeepSeek-R1 and recent Qwen3 templates
# do), so even a random model is inside its reasoning from the first token. A `mood` argument is
# written into a system turn, which lets tests see that other template arguments arrive too.
CHAT_TEMPLATE = (
    "{% if mood is defined %}<|im_start|>system\nmood={{ mood }}<|im_end|>\n{% endif %}"
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
    "{% endif %}"
)

HIDDEN = 128
HEAD_DIM = 64


def build_tokenizer(folder: Path) -> Any:
    """Trains a byte-level BPE on a few lines, adds the special tokens, saves it to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(TRAINING_LINES, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_tiny_model(folder: Path, *, seed: int = 0) -> Path:
    """A random 2-layer Qwen3 with the tokenizer above, saved as a folder vLLM can load."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    vocab = len(tokenizer)
    config = Qwen3Config(
        vocab_size=(vocab + 63) // 64 * 64,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HIDDEN // HEAD_DIM,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(folder)
    return folder


def write_config(folder: Path, **fields: object) -> Path:
    """A bare ``config.json`` (no weights), enough for choosing parsers from a model's config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields), encoding="utf-8")
    return folder
