"""A worker's view of one request: its id, its client, and its prompt ids and SamplingParams, derived the same
way on prefill and decode."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request

from pdruntime.server.openai.schemas import ApiError, GenerateRequest, default_max_tokens, parse_body, validate_generate


def request_id(req: GenerateRequest) -> str:
    """The worker-side id: the body's ``rid``, else one derived from ``bootstrap_room`` so that both legs of a PD
    request agree on it (SGLang's router sends the same body to prefill and decode, with a room and no rid)."""
    if req.rid:
        return req.rid
    return f"room-{req.bootstrap_room}" if req.bootstrap_room is not None else uuid.uuid4().hex


def client_of(request: Request) -> str:
    return request.headers.get("x-client-id") or "anonymous"


async def read_generate(request: Request) -> GenerateRequest:
    """A worker's ``/generate`` body, validated (the worker's HTTP edge)."""
    return validate_generate(parse_body(await request.body()))


class PromptBuilder:
    """Tokenizes a worker request the same way on prefill and decode, and derives SamplingParams."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int | None = None, *,
                 defaults: Any = None, tool_parser: str = "auto") -> None:
        from pdruntime.engine.defaults import GenerationDefaults
        from pdruntime.server.openai.tools import detect_parser, parser_for

        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.defaults = defaults or GenerationDefaults()  # the model's sampling defaults (--generation-config)
        template = getattr(tokenizer, "chat_template", None) or ""
        self.tool_parser = detect_parser(template) if tool_parser == "auto" else parser_for(tool_parser).name
        self.template_has_tools = "tools" in template

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            ids = list(req.input_ids)
            bad = next((i for i in ids if i >= self.vocab_size), None) if self.vocab_size is not None else None
            if bad is not None:
                raise ApiError(400, f"input_ids: token id {bad} is outside the vocabulary; accepted: token ids in "
                               f"[0, {self.vocab_size})", param="input_ids", code="invalid_value")
        elif req.messages is not None:
            from pdruntime.server.openai.tools import render_messages

            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools] if req.tools else None
            msgs = render_messages([m.model_dump(exclude_none=True) for m in req.messages], tools, self.tool_parser,
                                   self.template_has_tools)
            try:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **(
                    {"tools": tools} if tools and self.template_has_tools else {}))
            except Exception as exc:  # the template's own message may quote the conversation: type only
                raise ApiError(400, f"messages could not be rendered with the chat template ({type(exc).__name__}); "
                               "accepted: messages {role: system|user|assistant, content: text}", param="messages",
                               code="invalid_value") from None
            ids = self.tokenizer.encode(text)
        else:
            ids = self.tokenizer.encode(req.text or "")
        if not ids:
            raise ApiError(400, "the prompt is empty; accepted: at least one token", param="prompt",
                           code="invalid_value")
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                           f"tokens, accepted: a prompt under {self.max_model_len} tokens plus max_tokens",
                           param="messages" if req.messages is not None else "prompt", code="context_length_exceeded")
        return ids

    def sampling(self, req: GenerateRequest, prompt_len: int) -> Any:
        from pdruntime.engine import InvalidRequest, SamplingParams

        sp = req.sampling_params
        room = self.max_model_len - prompt_len
        max_tokens = sp.max_new_tokens if sp.max_new_tokens is not None else default_max_tokens(room)
        if max_tokens > room:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                           f"{self.max_model_len} tokens; accepted: max_tokens <= {room}", param="max_tokens",
                           code="context_length_exceeded")
        stop = () if sp.stop is None else ((sp.stop,) if isinstance(sp.stop, str) else tuple(s for s in sp.stop if s))
        d = self.defaults

        def pick(v, default):
            return default if v is None else v

        bias = {}
        for k, v in (sp.logit_bias or {}).items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < (self.vocab_size or 1 << 31):
                raise ApiError(400, f"logit_bias: key {k!r} is not a token id of this model; accepted: token ids in "
                               f"[0, {self.vocab_size})", param="logit_bias", code="invalid_value")
            bias[int(k)] = v
        grammar = sp.grammar
        if grammar is None and (req.response_format is not None or req.tools):
            from pdruntime.server.openai.structured import GrammarError, chat_grammar

            try:
                grammar = chat_grammar(req, self.tool_parser)
            except GrammarError as exc:
                raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
            except ValueError as exc:
                raise ApiError(400, f"response_format: {exc}", param="response_format", code="invalid_value") from None
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=pick(sp.temperature, d.temperature),
                                  top_k=max(0, pick(sp.top_k, d.top_k)), top_p=pick(sp.top_p, d.top_p),
                                  min_p=pick(sp.min_p, d.min_p),
                                  repetition_penalty=pick(sp.repetition_penalty, d.repetition_penalty),
                                  frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
                                  logit_bias=bias, logprobs=sp.logprobs, prompt_logprobs=sp.prompt_logprobs,
                                  stop_token_ids=tuple(sp.stop_token_ids or ()),
                                  grammar=grammar, seed=sp.seed, stop=stop, ignore_eos=sp.ignore_eos)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), code=exc.code) from None
