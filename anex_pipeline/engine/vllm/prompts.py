"""How a row becomes what the in-process engine is given: its prompt rendered with the model's
chat template and tokenised here (not inside ``LLM.chat``), so that each row keeps its own
chat-template arguments and a row that cannot be rendered is refused on its own; a chat row with
media on a multimodal model goes through vLLM's own chat renderer instead."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

from anex_pipeline.engine.base import EngineRequest
from anex_pipeline.engine.completions import one_prompt
from anex_pipeline.errors import AnexError
from anex_pipeline.media.audio import audio_problem
from anex_pipeline.request_fields import CHAT_TEXT_PARTS

# Content part type -> (vLLM's name of the modality, the word for it in messages).
MEDIA_PART_TYPES = {
    "image_url": ("image", "images"),
    "input_audio": ("audio", "audio"),
    "audio_url": ("audio", "audio"),
    "video_url": ("video", "video"),
}
MEDIA_WORDS = dict(MEDIA_PART_TYPES.values())


class RequestProblem(AnexError):
    """A row that cannot be sent to the model as it is."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class TextPrompts:
    """Renders and tokenises text rows with a model's tokenizer alone, as the engine does: a chat
    row through the model's chat template, a completions prompt as it is. ``context``: the
    model's context length, which ``truncate_prompt_tokens: -1`` keeps (None: not known, no cut)."""

    def __init__(self, tokenizer: Any, model_name: str, context: int | None = None):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context = context

    def prompt_ids(self, req: EngineRequest) -> list[int]:
        """The token ids of the row's prompt as the model sees it; raises RequestProblem for a row
        that cannot be rendered (media parts included: their tokens are the model processor's)."""
        return self._truncated(req, self._rendered_ids(req))

    def _truncated(self, req: EngineRequest, ids: list[int]) -> list[int]:
        """The prompt cut to the row's ``truncate_prompt_tokens`` (-1: the model's context), as
        vLLM's renderer cuts it: the last tokens kept when the tokenizer truncates on the left, else
        the first (Hugging Face's default side is the right)."""
        keep = req.body.get("truncate_prompt_tokens")
        if keep is None:
            return ids
        context = self.context
        if keep == -1:
            if context is None:
                return ids
            keep = context
        if context is not None and keep > context:
            raise RequestProblem(
                f"truncate_prompt_tokens is {keep} but the model's context holds {context}; "
                f"set it to at most {context}, or -1 for the whole context",
                "truncate_prompt_tokens",
            )
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if getattr(self.tokenizer, "truncation_side", None) == "left" else ids[:keep]

    def _rendered_ids(self, req: EngineRequest) -> list[int]:
        if req.endpoint == "chat":
            messages = [self._text_message(n, m) for n, m in enumerate(req.body["messages"])]
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tools=req.body.get("tools"),
                    tokenize=False,
                    **req.template_arguments,
                )
            except Exception as exc:  # the template itself refused the conversation
                raise RequestProblem(f"the model's chat template rejected the messages: {exc}", "messages") from None
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        prompt = one_prompt(req.body["prompt"])
        return list(prompt) if isinstance(prompt, list) else list(self.tokenizer.encode(prompt))

    def conversation_ids(self, req: EngineRequest) -> list[int]:
        """The tokens of an embeddings row's ``messages``, as vLLM's server renders them for an
        embedding: the model's chat template with no generation prompt unless the row asks for
        one, and no special tokens but the template's own."""
        continues = req.body.get("continue_final_message") is True
        messages = [self._text_message(n, m) for n, m in enumerate(req.body["messages"])]
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestProblem(
                f"model '{self.model_name}' has no chat template, so it cannot embed messages; give the text as input",
                "messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.body.get("add_generation_prompt", False),
                continue_final_message=continues,
                **req.chat_template_kwargs,
            )
        except Exception as exc:  # the template itself refused the conversation
            raise RequestProblem(f"the model's chat template rejected the messages: {exc}", "messages") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _text_message(self, n: int, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if not isinstance(content, list):
            return message
        texts = []
        for p, part in enumerate(content):
            kind = part.get("type")
            if kind in CHAT_TEXT_PARTS:
                texts.append(str(part.get("refusal" if kind == "refusal" else "text", "")))
            elif kind in MEDIA_PART_TYPES:
                raise RequestProblem(
                    f"model '{self.model_name}' takes text only and cannot read {MEDIA_PART_TYPES[kind][1]}; "
                    "remove the part or run the job on a multimodal model",
                    f"messages[{n}].content[{p}]",
                )
            else:
                raise RequestProblem(f"unknown content part type {kind!r}", f"messages[{n}].content[{p}].type")
        return {**message, "content": "".join(texts)}


class PromptRenderer(TextPrompts):
    """Renders and tokenises rows for one loaded ``vllm.LLM``."""

    def __init__(self, llm: Any, model_name: str):
        config = llm.llm_engine.model_config
        super().__init__(llm.get_tokenizer(), model_name, config.max_model_len)
        self.llm = llm
        self.multimodal = bool(getattr(config, "is_multimodal_model", False))
        self.modalities = _modalities(llm) if self.multimodal else frozenset()
        self.audio_rate = _fixed_audio_rate(llm) if "audio" in self.modalities else None

    def prompt_tokens(self, req: EngineRequest) -> array[int] | None:
        """The tokens of the row's rendered prompt, kept on the request (4 bytes a token) until it
        is sent; None when the row cannot be rendered (sending it refuses it with the reason)."""
        if self.multimodal and req.endpoint == "chat" and any(_media_parts(req.body["messages"])):
            return None  # vLLM's renderer makes its tokens (and the parts are checked) when it is sent
        try:
            req.prompt_ids = array("i", self._prompt_ids(req))
        except Exception:
            return None
        return req.prompt_ids

    def prompt(self, req: EngineRequest) -> tuple[Any, list[int]]:
        """What the engine is given for a row, and the prompt's token ids as the model sees them.

        A chat row with media on a multimodal model goes through vLLM's own chat renderer: it
        puts the model's placeholder for each image into the conversation, decodes the ``data:``
        URLs the media stage left and runs the model's processor, whose expanded token ids (one
        per image token) are what the row's usage and context room count. Every other row is
        rendered and tokenised here.
        """
        from vllm.inputs import TokensPrompt

        if self.multimodal and req.endpoint == "chat" and self._has_media(req.body["messages"]):
            from vllm.renderers import ChatParams

            kwargs = {**req.template_arguments, "tools": req.body.get("tools")}
            chat = ChatParams(chat_template_kwargs=kwargs, mm_processor_kwargs=req.body.get("mm_processor_kwargs"))
            _, prompts = self.llm.renderer.render_chat([req.body["messages"]], chat)
            return prompts[0], list(prompts[0]["prompt_token_ids"])
        ids = self._prompt_ids(req)
        return TokensPrompt(prompt_token_ids=ids), ids

    def _prompt_ids(self, req: EngineRequest) -> list[int]:
        if req.prompt_ids is not None:  # rendered ahead to order the rows: handed over once
            ids, req.prompt_ids = req.prompt_ids.tolist(), None
            return ids
        return self._truncated(req, self._rendered_ids(req))

    def _has_media(self, messages: list[dict[str, Any]]) -> bool:
        """Whether a multimodal model's row holds media; raises RequestProblem for a part of a kind
        the model cannot read or a sound it cannot decode, as vLLM's own refusal would not name
        the part (nor, for a sound, the reason)."""
        found = False
        for n, p, kind, part in _media_parts(messages):
            modality, word = MEDIA_PART_TYPES[kind]
            if modality not in self.modalities:
                reads = " and ".join(MEDIA_WORDS[m] for m in sorted(self.modalities))
                raise RequestProblem(
                    f"model '{self.model_name}' reads {reads} but cannot read {word}; "
                    f"remove the part or run the job on a model that reads {word}",
                    f"messages[{n}].content[{p}]",
                )
            problem = audio_problem(kind, part.get(kind), self.audio_rate) if modality == "audio" else None
            if problem is not None:
                raise RequestProblem(problem, f"messages[{n}].content[{p}]")
            found = True
        return found


def _modalities(llm: Any) -> frozenset[str]:
    """The kinds of media (vLLM's names: image, audio, video) a multimodal model reads."""
    limits = llm.renderer.get_mm_processor().info.allowed_mm_limits
    return frozenset(kind for kind, most in limits.items() if most > 0)


def _fixed_audio_rate(llm: Any) -> int | None:
    """The sampling rate every sound must already have for an audio model, or None when vLLM can
    bring a sound to the model's rate: it resamples with torchaudio, which the CPU build lacks."""
    import importlib.util

    if importlib.util.find_spec("torchaudio") is not None:
        return None
    extractor = getattr(llm.renderer.get_mm_processor().info.get_hf_processor(), "feature_extractor", None)
    rate = getattr(extractor, "sampling_rate", None)
    return int(rate) if rate else None


def _media_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, str, dict[str, Any]]]:
    """Each media part of a chat row: message number, part number, part type and the part."""
    for n, message in enumerate(messages):
        content = message.get("content")
        for p, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PART_TYPES:
                yield n, p, kind, part
