"""Input processing: prompts -> validated token ids (tokenisation, chat template), the sampling
parameter checks that need the model, and the fan-out of a request into the engine core's
sequences (`CoreRequest`, one per n). It runs where the request arrives: in the caller's process
offline, in the API process(es) under `moe serve`."""
from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass, field

from moe.engine.chat_template import ChatTemplate, check_messages, check_template_kwargs
from moe.engine.core import CoreRequest
from moe.engine.model_info import ModelInfo
from moe.sampling_params import SamplingParams

logger = logging.getLogger("moe.engine.llm_engine")


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    mm_items: list = field(default_factory=list)  # its images (moe/multimodal/inputs.py's ImageItem)


# Content parts of a chat message that carry an image, and the key holding the image: OpenAI's
# image_url ({"url": data URL} or the URL itself), vLLM's image_pil, transformers' image.
_IMAGE_PARTS = {"image_url": "image_url", "image_pil": "image_pil", "image": "image"}


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine core's id of sequence `index` of a request with n sequences."""
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.vocab_size = info.model_config.vocab_size
        self.max_model_len = info.max_model_len
        self.max_logprobs = info.max_logprobs
        self._warned_max_tokens_cap = False
        self._chat_template: ChatTemplate | None | bool = False  # False: not loaded yet
        self._images = None  # moe.multimodal.processing.ImageProcessing, made at the first image
        self.metrics = None  # EngineMetrics: processor-cache lookups are counted there when set
        # moe serve with one engine core: the IPC cache's sender, whose keys stand for the pixels
        # the core holds (this process then keeps no pixels of its own between requests).
        self.ipc_sender = None

    @property
    def images(self):
        if self._images is None:
            if not self.info.image_limit:
                why = ", limit_mm_per_prompt turned them off" if self.info.args.limit_mm_per_prompt else ""
                raise ValueError(f"the model at {self.info.model_path!r} takes no images (text only{why})")
            from moe.multimodal.processing import ImageProcessing
            args = self.info.args
            self._images = ImageProcessing(self.info.model_path, self.tokenizer, self.info.image_limit,
                                           args.mm_processor_cache_gb, self.info.model_config.vision.image_size)
            if self.ipc_sender is not None:
                self._images.use_keys_only(self.ipc_sender)
        return self._images

    def process_prompt(self, prompt, truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """A string, {"prompt": str} or {"prompt_token_ids": [...]} (either dict with
        "multi_modal_data": {"image": image or [images]}) -> validated token ids, with each
        <|image|> of the prompt expanded into its image's tokens. truncate_prompt_tokens=k keeps
        the last k tokens (-1: max_model_len), cut before the checks, so a long prompt cut to fit
        runs (vLLM's rule)."""
        p = self._tokenize(prompt)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data is not None:
            p.prompt_token_ids, p.mm_items = self._process_images(p.prompt_token_ids, mm_data)
        return self._check_tokens(self.truncate(p, truncate_prompt_tokens))

    def truncate(self, p: ProcessedPrompt, truncate_prompt_tokens: int | None) -> ProcessedPrompt:
        """p with only its last truncate_prompt_tokens tokens (-1: max_model_len; p itself when it
        has no more). A prompt with images cannot be cut: its image tokens would lose their features."""
        k = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if k is None or len(p.prompt_token_ids) <= k:
            return p
        if p.mm_items:
            raise ValueError("invalid sampling parameter truncate_prompt_tokens: a prompt with images cannot be "
                             f"truncated ({len(p.prompt_token_ids)} tokens, truncate_prompt_tokens={k})")
        return ProcessedPrompt(p.prompt, p.prompt_token_ids[-k:])

    def _process_images(self, prompt_token_ids: list[int], mm_data) -> tuple[list[int], list]:
        images = self.images
        queries, hits = images.queries, images.hits
        try:
            return images.process(prompt_token_ids, mm_data)
        finally:
            if self.metrics is not None:
                self.metrics.mm_cache_queries.inc(images.queries - queries)
                self.metrics.mm_cache_hits.inc(images.hits - hits)

    def _tokenize(self, prompt) -> ProcessedPrompt:
        text = None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of integers (not bools)")
            if all(type(t) is int for t in ids):  # the usual case, ~10x faster than the ABC check
                return ProcessedPrompt(prompt.get("prompt"), list(ids))
            if not all(_is_token_id(t) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers (not bools)")
            return ProcessedPrompt(prompt.get("prompt"), [int(t) for t in ids])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
        else:
            raise ValueError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                             f"got {type(prompt).__name__}")
        if not isinstance(text, str):
            raise ValueError(f"a text prompt must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid Unicode text: {e.reason} at position {e.start} "
                             f"({text[e.start:e.end]!r})") from None
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json: pass {'prompt_token_ids': [...]} "
                             "or tokenizer=<folder with tokenizer.json>")
        return ProcessedPrompt(text, self.tokenizer.encode(text))

    @property
    def chat_template(self) -> ChatTemplate | None:
        if self._chat_template is False:
            self._chat_template = ChatTemplate.load(self._template_folder())
        return self._chat_template

    def _template_folder(self) -> str:
        return self.tokenizer.path if self.tokenizer is not None else self.info.model_path

    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` instead of the checkpoint's template (`moe serve --chat-template`);
        a request's own chat_template still wins."""
        self._chat_template = ChatTemplate(source, ChatTemplate.special_tokens_of(self._template_folder()))

    # The arguments before `/` are positional-only, so that a chat_template_kwargs key such as
    # "messages" lands in **kwargs and is refused by name (check_template_kwargs), not a TypeError.
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict] | None = None, /, **kwargs) -> str:
        """The conversation as the prompt text the model was trained on (the checkpoint's template);
        tools: the functions the model may call, for the template to describe."""
        check_template_kwargs(kwargs)
        template = self.chat_template
        if chat_template is not None:
            template = ChatTemplate(chat_template, template.special_tokens if template else
                                    ChatTemplate.special_tokens_of(self._template_folder()))
        if template is None:
            raise ValueError(f"the model at {self.info.model_path!r} has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja): give one (the request's chat_template, "
                             "`moe serve --chat-template FILE`, or LLM.chat(..., chat_template=...)), or use "
                             "completions / generate with a prompt")
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def process_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                     chat_template: str | None = None, tools: list[dict] | None = None, /,
                     **kwargs) -> ProcessedPrompt:
        check_messages(messages)  # before split_chat_images, which reads the parts
        check_template_kwargs(kwargs)
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this model folder has no tokenizer.json")
        messages, images = split_chat_images(messages)
        text = self.render_chat(messages, add_generation_prompt, chat_template, tools, **kwargs)
        # The template writes the special tokens itself (as transformers' apply_chat_template does).
        p = ProcessedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))
        if images:
            p.prompt_token_ids, p.mm_items = self._process_images(p.prompt_token_ids, {"image": images})
        return self._check_tokens(p)

    def _check_tokens(self, p: ProcessedPrompt) -> ProcessedPrompt:
        ids, vocab = p.prompt_token_ids, self.vocab_size
        if not ids:
            raise ValueError("the prompt is empty (it has no tokens)")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (vocab_size={vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt (length {len(ids)}) is longer than the maximum model length "
                             f"max_model_len={self.max_model_len}")
        if not p.mm_items and self.info.image_limit:
            # Placeholders or expansion tokens no image backs would make the vision path misread
            # the prompt (with images, ImageProcessing.process checked them one to one).
            self.images.tokens.check_prompt_ids(ids, 0)
        return p

    def check_context_length(self, prompt_len: int, max_tokens: int, prompt_what: str = "the prompt",
                             max_tokens_name: str = "max_tokens") -> None:
        """A max_tokens the client asked for that does not fit beside the prompt is refused (as by
        vLLM's server), not quietly capped: the caller would get less than it asked for. An unset
        max_tokens is capped to fit (_max_tokens)."""
        limit = self.max_model_len
        if prompt_len + max_tokens > limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens, but this request asks for "
                             f"{prompt_len + max_tokens} tokens ({prompt_len} in {prompt_what}, {max_tokens} in the "
                             f"completion): shorten {prompt_what} or lower {max_tokens_name} to at most "
                             f"{max(limit - prompt_len, 0)}")

    def check_params(self, params: SamplingParams) -> None:
        """The checks of SamplingParams that need the model: raised before anything is queued."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > min(self.max_logprobs, vocab):
                which = f"max_logprobs={self.max_logprobs}" if self.max_logprobs <= vocab else f"vocab_size={vocab}"
                raise ValueError(f"invalid sampling parameter {name}={k}: at most {which} "
                                 "(the engine argument max_logprobs raises the limit, up to the vocabulary size)")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"invalid sampling parameter stop_token_ids: token id {bad[0]} is out of vocabulary "
                             f"(vocab_size={vocab})")
        # token ids of logit_bias / allowed_token_ids against the vocabulary, bad_words into token ids
        params.update_from_tokenizer(self.tokenizer, vocab)
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's constraint here too, so that a bad schema, regex or grammar is a
        ValueError naming it before anything is queued (the server answers 400); the engine core
        compiles it again through its own cache."""
        config = self.info.args.structured_outputs
        spec = config.apply(params.structured_outputs)
        if config.backend_for(spec) == "xgrammar":
            from moe.structured_output.xgrammar_backend import grammar

            grammar(spec)  # no tokenizer needed to check a spec
            return
        from moe.structured_output.grammar import ll_tokenizer, validate

        tokenizer = ll_tokenizer(self.tokenizer, self.vocab_size, tuple(self.info.eos_token_ids))
        validate(spec, tokenizer)

    def _max_tokens(self, request_id: str, params: SamplingParams, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            return max(room, 1)
        if params.max_tokens > room:
            level = logging.DEBUG if self._warned_max_tokens_cap else logging.WARNING
            logger.log(level, "request %s: max_tokens=%d is capped to %d, what max_model_len=%d leaves after its "
                       "%d prompt tokens%s", request_id, params.max_tokens, max(room, 1), self.max_model_len,
                       prompt_len, "" if self._warned_max_tokens_cap else " (further cappings are logged at DEBUG)")
            self._warned_max_tokens_cap = True
            return max(room, 1)
        return params.max_tokens

    def make_core_requests(self, request_id: str, p: ProcessedPrompt, params: SamplingParams) -> list[CoreRequest]:
        """One engine-core sequence per n; with a seed, sequence i samples with seed + i. The n
        sequences share one prompt, so only sequence 0 computes its prompt_logprobs (the others
        then need no logits of the prompt and may read it from the prefix cache)."""
        max_tokens = self._max_tokens(request_id, params, len(p.prompt_token_ids))
        return [CoreRequest(child_request_id(request_id, i, params.n), p.prompt_token_ids, max_tokens,
                            _child_params(params, i), self.info.eos_token_ids, p.mm_items)
                for i in range(params.n)]


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s params: its own seed (seed + index), no prompt_logprobs past sequence 0."""
    if params.n == 1 or (params.seed is None and params.prompt_logprobs is None):
        return params
    changes = {}
    if params.seed is not None:
        changes["seed"] = params.seed + index
    if index > 0 and params.prompt_logprobs is not None:
        changes["prompt_logprobs"] = None
    return params.clone(**changes) if changes else params


def split_chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """The conversation with each image part as {"type": "image"} (what chat templates render as the
    model's image placeholder), and the images in order of appearance."""
    if not isinstance(messages, list):
        return messages, []
    images, out = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _IMAGE_PARTS:
                value = part.get(_IMAGE_PARTS[kind])
                if kind == "image_url" and isinstance(value, dict):
                    value = value.get("url")
                if value is None:
                    raise ValueError(f"a chat content part of type {kind!r} has no {_IMAGE_PARTS[kind]!r}")
                images.append(value)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, images
