"""Transcription and translation rows on a loaded speech-to-text model (Whisper), made as
``vllm serve``'s ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` make them.

The steps are vLLM's own server code, run without a server: the row's fields are read by vLLM's
request model (its checks and defaults), the sound is decoded and, past the model's window (30 s
for Whisper), split where it is quietest near each window's end, as the server splits it; the
language is detected from the first piece when the row names none; each piece gets the model's
prompt, and the pieces' texts are joined as the server joins them. The serving object whose
methods do this is made without its engine client (only its model, its tokenizer and its
configuration are read), as :mod:`.outputs` does for logprobs. Each piece is one engine request;
a group's pieces all go to the engine together.
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from anex_pipeline.engine.base import EngineRequest, rejected
from anex_pipeline.request_fields import TRANSCRIPTIONS
from anex_pipeline.spec import RowOutcome

TASKS = {"transcriptions": "transcribe", "translations": "translate"}


@dataclass
class _Row:
    """One row on its way: vLLM's request, its sound's pieces and what they became."""

    req: EngineRequest
    request: Any  # vLLM's TranscriptionRequest or TranslationRequest
    duration: float
    offsets: list[float]  # where each piece starts, in seconds
    inputs: list[Any]  # the engine input of each piece
    params: Any
    outputs: list[Any] = field(default_factory=list)


class SpeechRows:
    """Runs transcription and translation rows on one loaded ``vllm.LLM``."""

    def __init__(self, llm: Any, model_name: str):
        self.llm = llm
        self.model_name = model_name
        self._servings: dict[str, Any] = {}
        self._ids = itertools.count()

    def serving(self, task: str) -> Any:
        """vLLM's serving object of the task ("transcribe" or "translate"), without an engine client."""
        if task not in self._servings:
            import vllm.envs as envs
            from vllm.entrypoints.speech_to_text.transcription.serving import OpenAIServingTranscription
            from vllm.entrypoints.speech_to_text.translation.serving import OpenAIServingTranslation
            from vllm.model_executor.model_loader import get_model_cls

            config = self.llm.llm_engine.model_config
            made = object.__new__(OpenAIServingTranscription if task == "transcribe" else OpenAIServingTranslation)
            made.__dict__["model_cls"] = get_model_cls(config)  # a cached property of the class
            made.model_config = config
            made.task_type = task
            made.default_sampling_params = config.get_diff_sampling_param()
            made.asr_config = made.model_cls.get_speech_to_text_config(config, task)
            made.max_audio_decode_duration_s = envs.VLLM_MAX_AUDIO_DECODE_DURATION_S
            made.max_audio_decode_bytes = envs.VLLM_MAX_AUDIO_DECODE_BYTES
            made.tokenizer = self.llm.get_tokenizer()
            self._servings[task] = made
        return self._servings[task]

    def run(self, requests: list[EngineRequest]) -> list[RowOutcome]:
        """Every row's answer (a row that cannot run fails alone with vLLM's reason)."""
        outcomes: dict[int, RowOutcome] = {}
        rows: list[_Row] = []
        for req in requests:
            try:
                rows.append(self._prepared(req))
            except (ValueError, TypeError) as exc:  # vLLM's own checks (VLLMValidationError is a ValueError)
                outcomes[req.index] = rejected(req, _reason(req, exc), getattr(exc, "parameter", None) or "file_url")
        pieces = [(row, n, engine_input) for row in rows for n, engine_input in enumerate(row.inputs)]
        finished = self._generate([(engine_input, row.params) for row, _, engine_input in pieces])
        for (row, _, _), output in zip(pieces, finished, strict=True):
            row.outputs.append(output)
        for row in rows:
            outcomes[row.req.index] = self._answer(row)
        return [outcomes[r.index] for r in requests]

    def _prepared(self, req: EngineRequest) -> _Row:
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.entrypoints.speech_to_text.transcription.protocol import (  # the upload class vLLM's model takes
            TranscriptionRequest,
            UploadFile,
        )
        from vllm.entrypoints.speech_to_text.translation.protocol import TranslationRequest
        from vllm.renderers.inputs.preprocess import parse_enc_dec_prompt, parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        serving = self.serving(TASKS[req.endpoint])
        sound = _sound(req.body["file_url"])
        fields = {k: v for k, v in req.body.items() if k not in ("file_url", "model")}
        fields.update(req.sampling)
        kind = TranscriptionRequest if req.endpoint == TRANSCRIPTIONS else TranslationRequest
        request = kind.model_validate({**fields, "file": UploadFile(file=io.BytesIO(sound), filename="audio.bin")})
        if request.response_format not in ("json", "text", "verbose_json"):
            raise ValueError("Currently only support response_format: `text`, `json`, `verbose_json`")
        cls = serving.model_cls
        request.language = cls.validate_language(request.language)
        request.to_language = cls.validate_language(request.to_language) if request.to_language else None
        chunks, duration = serving._decode_and_chunk_speech(sound)
        offsets = [0.0]
        for chunk in chunks[:-1]:
            offsets.append(offsets[-1] + chunk.shape[-1] / serving.asr_config.sample_rate)
        if request.language is None and getattr(cls, "supports_explicit_language_detection", False):
            request.language = self._detected_language(serving, chunks[0])
        prompts = []
        for chunk in chunks:
            params = request.build_stt_params(
                audio=chunk,
                stt_config=serving.asr_config,
                model_config=serving.model_config,
                task_type=serving.task_type,
            )
            prompt = cls.get_generation_prompt(params)
            if request.response_format == "verbose_json":
                prompts.append(serving._preprocess_verbose_prompt(parse_enc_dec_prompt(prompt)))
            else:
                prompts.append(parse_model_prompt(serving.model_config, prompt))
        inputs = self.llm.renderer.render_cmpl(prompts)
        defaults = serving.default_sampling_params
        cap = get_max_tokens(serving.model_config.max_model_len, request.max_completion_tokens, 0, defaults)
        sampling = request.to_sampling_params(cap, defaults)
        if request.response_format == "verbose_json":
            sampling.logprobs = 1
        sampling.output_kind = RequestOutputKind.FINAL_ONLY
        return _Row(req, request, duration, offsets, list(inputs), sampling)

    def _detected_language(self, serving: Any, chunk: Any) -> str:
        """The language the model hears in the first piece, as the server detects it (one token)."""
        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        cls = serving.model_cls
        prompt = cls.get_language_detection_prompt(chunk, serving.asr_config)
        [engine_input] = self.llm.renderer.render_cmpl([parse_model_prompt(serving.model_config, prompt)])
        allowed = cls.get_language_token_ids(serving.tokenizer)
        params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=allowed, watermarking=False)
        [output] = self._generate([(engine_input, params)])
        return cls.parse_language_detection_output(list(output.outputs[0].token_ids), serving.tokenizer)

    def _generate(self, work: list[tuple[Any, Any]]) -> list[Any]:
        """The finished engine output of each (engine input, sampling parameters), in order."""
        engine = self.llm.llm_engine
        ids = [f"anex-speech-{next(self._ids)}" for _ in work]
        for request_id, (engine_input, params) in zip(ids, work, strict=True):
            engine.add_request(request_id, engine_input, params)
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[request_id] for request_id in ids]

    def _answer(self, row: _Row) -> RowOutcome:
        """The row's response, as the server makes it from its pieces' outputs."""
        from vllm.entrypoints.speech_to_text.base.serving import asr_inter_chunk_separator
        from vllm.entrypoints.speech_to_text.transcription.protocol import (
            TranscriptionResponse,
            TranscriptionResponseVerbose,
            TranscriptionSegment,
        )
        from vllm.entrypoints.speech_to_text.translation.protocol import (
            TranslationResponse,
            TranslationResponseVerbose,
            TranslationSegment,
        )

        req, request = row.req, row.request
        serving = self.serving(TASKS[req.endpoint])
        transcribing = req.endpoint == TRANSCRIPTIONS
        verbose = request.response_format == "verbose_json"
        if any(o.outputs[0].finish_reason not in ("stop", "length") for o in row.outputs):
            from anex_pipeline.engine.base import engine_failure

            return engine_failure(req, "generation ended abnormally")
        texts, segments = [], []
        for output, start in zip(row.outputs, row.offsets, strict=True):
            answer = output.outputs[0]
            if verbose:
                found = serving._get_verbose_segments(
                    tokens=tuple(answer.token_ids),
                    log_probs=answer.logprobs,
                    request=request,
                    segment_class=TranscriptionSegment if transcribing else TranslationSegment,
                    start_time=start,
                )
                segments += found
                texts += [s.text for s in found]
            else:
                texts.append(serving.model_cls.post_process_output(answer.text))
        text = asr_inter_chunk_separator(request.language, serving.model_cls.no_space_languages).join(texts)
        if verbose:
            made = (TranscriptionResponseVerbose if transcribing else TranslationResponseVerbose)(
                text=text, language=request.language, duration=row.duration, segments=segments
            )
        elif transcribing:
            made = TranscriptionResponse(text=text, usage={"type": "duration", "seconds": math.ceil(row.duration)})
        else:
            made = TranslationResponse(text=text)
        usage = {
            "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in row.outputs),
            "completion_tokens": sum(len(o.outputs[0].token_ids) for o in row.outputs),
        }
        return RowOutcome(req.index, req.key, 200, body=made.model_dump(mode="json"), usage=usage)


def _sound(url: str) -> bytes:
    """The bytes of a ``data:`` URL's sound (the media stage made every file_url one)."""
    header, _, payload = url.partition(",")
    if not url.startswith("data:") or not header.endswith(";base64"):
        raise ValueError("file_url must be an http(s) URL or a base64 data: URL")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the file_url data is not valid base64") from None


def _reason(req: EngineRequest, exc: Exception) -> str:
    """vLLM's refusal of a row, worded as the server words it."""
    operation = "transcription" if req.endpoint == TRANSCRIPTIONS else "translation"
    return f"Failed to process {operation}: {exc}"
