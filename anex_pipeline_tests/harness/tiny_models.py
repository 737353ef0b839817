"""Tiny random models built offline, for tests that need a reasoning or tool-calling model format,
or a model that reads images (:func:`build_tiny_vision_model`) or sounds (:func:`build_tiny_audio_model`).

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
IMAGE_TOKEN = "<image>"
# Idefics3's tokens around and inside an image; the row/column tags name tiles (unused here, but
# the processor looks them up).
VISION_TOKENS = (
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)
# The sizes of every tiny media encoder (vision tower, audio encoder), in transformers' common names.
ENCODER_FIELDS = {
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": HIDDEN // HEAD_DIM,
}
VISION_IMAGE_SIZE = 112
VISION_PATCH = 14
VISION_SCALE = 2  # the connector merges VISION_SCALE**2 patches into one token
VISION_IMAGE_TOKENS = (VISION_IMAGE_SIZE // VISION_PATCH) ** 2 // VISION_SCALE**2
AUDIO_TOKEN = "<|AUDIO|>"
AUDIO_TOKENS = ("<|audio_bos|>", AUDIO_TOKEN, "<|audio_eos|>")  # Qwen2-Audio's markers around a sound
AUDIO_RATE = 16000  # the feature extractor's sampling rate: sounds at this rate need no resampling


def build_tokenizer(folder: Path, extra_special: tuple[str, ...] = ()) -> Any:
    """Trains a byte-level BPE on a few lines, adds the special tokens (and ``extra_special``),
    saves it to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + list(extra_special)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(TRAINING_LINES, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=specials[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 2048
    tokenizer.save_pretrained(folder)
    return tokenizer


def decoder_fields(tokenizer: Any) -> dict[str, Any]:
    """The config fields of the 2-layer decoder every tiny model has, sized for ``tokenizer``."""
    return {
        "vocab_size": (len(tokenizer) + 63) // 64 * 64,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": HIDDEN // HEAD_DIM,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 2048,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }


def save_random(model_class: Any, config: Any, folder: Path, *, seed: int) -> None:
    """Saves a ``model_class`` of ``config`` with random float32 weights (the same for a seed)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    text = config.get_text_config()
    model.generation_config = GenerationConfig(eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    model.save_pretrained(folder)


def build_tiny_model(folder: Path, *, seed: int = 0) -> Path:
    """A random 2-layer Qwen3 with the tokenizer above, saved as a folder vLLM can load."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = Qwen3Config(**decoder_fields(tokenizer), tie_word_embeddings=True)
    save_random(Qwen3ForCausalLM, config, folder, seed=seed)
    return folder


def build_tiny_vision_model(folder: Path, *, seed: int = 0) -> Path:
    """A random Idefics3 (a 2-layer SigLIP-style vision tower, a pixel-shuffle connector and a
    2-layer Llama) with its real image processor and the tokenizer above plus Idefics3's image
    tokens, saved as a folder vLLM can load.

    Idefics3 rather than LLaVA: vLLM 0.32's LLaVA module imports torchvision (through Pixtral),
    which the CPU build cannot have. Images are not split into tiles: each is resized to
    VISION_IMAGE_SIZE square and becomes VISION_IMAGE_TOKENS tokens (the patches, merged four to
    one by the connector) between its marker tokens.
    """
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, extra_special=VISION_TOKENS)
    text = LlamaConfig(**decoder_fields(tokenizer), tie_word_embeddings=False)
    vision = Idefics3VisionConfig(**ENCODER_FIELDS, image_size=VISION_IMAGE_SIZE, patch_size=VISION_PATCH)
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        scale_factor=VISION_SCALE,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    save_random(Idefics3ForConditionalGeneration, config, folder, seed=seed)
    side = {"longest_edge": VISION_IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side)
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=VISION_IMAGE_TOKENS, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(folder)
    return folder


def build_tiny_audio_model(folder: Path, *, seed: int = 0) -> Path:
    """A random Qwen2-Audio (a 2-layer Whisper-style audio encoder, a linear projector and a
    2-layer Qwen2) with its real processor (Whisper's feature extractor: 128 mel bins at 16 kHz)
    and the tokenizer above plus Qwen2-Audio's audio tokens, saved as a folder vLLM can load.

    Qwen2-Audio rather than Ultravox: every part of it is in transformers, while Ultravox's
    processor is remote code. A sound becomes one mel frame per 10 ms, which the encoder's strided
    convolution and then its pooling each halve (0.5 s: 50 frames, 25, then 12 audio tokens,
    between its marker tokens).
    """
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, extra_special=AUDIO_TOKENS)
    text = Qwen2Config(**decoder_fields(tokenizer), tie_word_embeddings=False)
    audio = Qwen2AudioEncoderConfig(**ENCODER_FIELDS, num_mel_bins=128)
    config = Qwen2AudioConfig(
        audio_config=audio.to_dict(),
        text_config=text.to_dict(),
        audio_token_index=tokenizer.convert_tokens_to_ids(AUDIO_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    save_random(Qwen2AudioForConditionalGeneration, config, folder, seed=seed)
    _undouble_language_model_keys(folder / "model.safetensors")
    sounds = WhisperFeatureExtractor(feature_size=128, sampling_rate=AUDIO_RATE)
    Qwen2AudioProcessor(feature_extractor=sounds, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(
        folder
    )
    return folder


def _undouble_language_model_keys(weights: Path) -> None:
    """transformers 5 saves Qwen2-Audio's decoder as ``language_model.model.model.*`` (its
    renaming to the new layout, undone twice on the way out); vLLM and the published checkpoints
    name it ``language_model.model.*``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    renamed = {k.replace("language_model.model.model.", "language_model.model.", 1): v for k, v in tensors.items()}
    save_file(renamed, weights, metadata={"format": "pt"})


def write_config(folder: Path, **fields: object) -> Path:
    """A bare ``config.json`` (no weights), enough for choosing parsers from a model's config."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields), encoding="utf-8")
    return folder


def build_matryoshka_embedding_model(dest: Path) -> Path:
    """The embedded all-MiniLM-L6-v2 declared a Matryoshka model (``matryoshka_dimensions`` in its
    config, as such models declare it) and given a chat template (EMBEDDING_CHAT_TEMPLATE, so that
    it embeds messages as vLLM's server does), its other files linked, not copied: vLLM then
    shortens its vectors to a row's ``dimensions``, which is all a test of that field needs to see."""
    from anex_pipeline.engine.models import embedding_model_dir

    source = embedding_model_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("config.json", "tokenizer_config.json"):
            (dest / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["matryoshka_dimensions"] = [128, 256, 384]
    (dest / "config.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer["chat_template"] = EMBEDDING_CHAT_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    return dest


# A BERT-style chat template: the conversation between the model's own [CLS] and [SEP], a role
# before each message, and a marker for the answer when a generation prompt is asked for.
EMBEDDING_CHAT_TEMPLATE = (
    "[CLS] {% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}[SEP]"
)


def build_tiny_cross_encoder(folder: Path, *, seed: int = 0) -> Path:
    """A random 2-layer ``BertForSequenceClassification`` with one label (what vLLM scores pairs
    with as a cross-encoder), on the embedded MiniLM's BERT tokenizer (its files copied)."""
    return build_tiny_classifier(folder, labels=None, seed=seed)


# The classes of the tiny sequence classifier, in the order of its outputs.
CLASSIFIER_LABELS = ("negative", "neutral", "positive")


def build_tiny_classifier(folder: Path, *, labels: tuple[str, ...] | None = CLASSIFIER_LABELS, seed: int = 0) -> Path:
    """A random 2-layer ``BertForSequenceClassification`` on the embedded MiniLM's BERT tokenizer
    (its files copied): with ``labels``, a classifier of those classes (named in ``id2label``, as
    vLLM's classify answers name them); without, one label, a cross-encoder."""
    import shutil

    from transformers import BertConfig, BertForSequenceClassification

    from anex_pipeline.engine.models import embedding_model_dir

    folder.mkdir(parents=True, exist_ok=True)
    source = embedding_model_dir()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    named = {} if labels is None else {"id2label": dict(enumerate(labels))}
    config = BertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HIDDEN // HEAD_DIM,
        max_position_embeddings=512,
        num_labels=1 if labels is None else len(labels),
        initializer_range=0.5,  # BERT's 0.02 gives every input nearly the same output
        **named,
    )
    save_random(BertForSequenceClassification, config, folder, seed=seed)
    return folder


# Lines the tiny Whisper's tokenizer is trained on (its text is noise whatever they say).
WHISPER_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a test of the transcription system.",
    "The weather in London is cloudy with a chance of rain today.",
    "One two three four five six seven eight nine ten.",
)
WHISPER_CONTEXT = 448  # Whisper's decoder context (max_target_positions): vLLM caps every answer by it


def build_tiny_whisper(folder: Path, *, seed: int = 0) -> Path:
    """A random Whisper (2 encoder and 2 decoder layers, d_model 128 in heads of 64, 80 mel bins)
    with Whisper's real feature extractor and a byte-level BPE tokenizer trained here that carries
    Whisper's special tokens: the start of a transcript, every language of transformers' list, the
    task and timestamp switches, then the 1,501 timestamps <|0.00|> to <|30.00|> (highest ids, in
    order, as vLLM's segmenting of verbose answers needs). The encoder keeps Whisper's 1,500
    positions: the feature extractor pads every sound to 30 s (3,000 frames), halved by the
    encoder's strided convolution."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    folder.mkdir(parents=True, exist_ok=True)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(WHISPER_LINES, trainer=trainer)
    trained = json.loads(core.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    specials = [
        "<|startoftranscript|>",
        *(f"<|{code}|>" for code in LANGUAGES),
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nocaptions|>",
        "<|notimestamps|>",
    ]
    tokenizer = WhisperTokenizer(vocab=trained["vocab"], merges=merges, additional_special_tokens=specials)
    tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    tokenizer.model_max_length = WHISPER_CONTEXT
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    config = WhisperConfig(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        num_mel_bins=80,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=HIDDEN // HEAD_DIM,
        decoder_attention_heads=HIDDEN // HEAD_DIM,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        d_model=HIDDEN,
        max_source_positions=1500,
        max_target_positions=WHISPER_CONTEXT,
        decoder_start_token_id=start,
        eos_token_id=end,
        bos_token_id=end,
        pad_token_id=end,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        init_std=0.5,  # a wider spread than Whisper's, so that different sounds get different texts
    )
    save_random(WhisperForConditionalGeneration, config, folder, seed=seed)
    from transformers import GenerationConfig

    GenerationConfig(
        decoder_start_token_id=start, eos_token_id=end, pad_token_id=end, max_length=WHISPER_CONTEXT
    ).save_pretrained(folder)
    sounds = WhisperFeatureExtractor(feature_size=80, sampling_rate=AUDIO_RATE)
    WhisperProcessor(feature_extractor=sounds, tokenizer=tokenizer).save_pretrained(folder)
    return folder


NEAR_FREE_HIDDEN = 64  # one attention head of HEAD_DIM: the narrowest decoder the CPU attention backend takes


def build_near_free_chat_model(folder: Path, *, seed: int = 0) -> Path:
    """A random 2-layer Llama, NEAR_FREE_HIDDEN wide with one head, on the embedded SmolLM2's
    tokenizer and chat template (its files copied): rows are rendered and tokenised as for the
    embedded model, but a forward pass costs next to nothing, so a job on it measures the code
    around the model. The embedding is SmolLM2's vocabulary (49,152) by NEAR_FREE_HIDDEN, tied
    to the output layer; a token of KV cache is 1 KiB."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from anex_pipeline.engine.models import prepare_default_chat_model

    folder.mkdir(parents=True, exist_ok=True)
    source = prepare_default_chat_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, folder / name)
    like = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config = LlamaConfig(
        vocab_size=like["vocab_size"],
        hidden_size=NEAR_FREE_HIDDEN,
        intermediate_size=2 * NEAR_FREE_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=NEAR_FREE_HIDDEN // HEAD_DIM,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        max_position_embeddings=like["max_position_embeddings"],
        bos_token_id=like["bos_token_id"],
        eos_token_id=like["eos_token_id"],
        pad_token_id=like["pad_token_id"],
        tie_word_embeddings=True,
    )
    save_random(LlamaForCausalLM, config, folder, seed=seed)
    return folder
