"""vLLM's `/tokenize` and `/detokenize`, with its request and response shapes.

RL clients (verifiers' token client, prime-rl) tokenize chat messages with the server's own chat
template to build the next turn's prompt ids, so these must render exactly as
/v1/chat/completions does: the same template, tools and template kwargs (services/decode/openai.py).
"""

from __future__ import annotations

from tokenizers import Tokenizer

from services.common.chat import ChatTemplate, ChatTemplateError
from services.common.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from services.decode.openai import PromptError, message_dict


def render_for_tokenize(req: TokenizeRequest, template: ChatTemplate | None) -> str:
    """The chat prompt text of `req.messages`. `continue_final_message` leaves the last message
    open (the text ends with its content, as transformers' apply_chat_template does)."""
    assert req.messages is not None
    if template is None:
        raise PromptError("messages", "this model directory has no chat template; tokenize a prompt")
    messages = [message_dict(i, m) for i, m in enumerate(req.messages)]
    try:
        text = template.render(
            messages,
            req.tools,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            variables=req.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise PromptError("messages", f"the chat template rejected them: {e}") from None
    if req.continue_final_message:
        last = messages[-1].get("content") or ""
        at = text.rfind(last.strip()) if last.strip() else -1
        if at < 0:
            raise PromptError(
                "messages", "continue_final_message: the final message's content is not in the rendering"
            )
        text = text[: at + len(last.strip())]
    return text


def tokenize(
    req: TokenizeRequest, tokenizer: Tokenizer | None, template: ChatTemplate | None, max_model_len: int
) -> TokenizeResponse:
    if tokenizer is None:
        raise PromptError(
            "prompt" if req.prompt is not None else "messages", "this model directory has no tokenizer.json"
        )
    if req.prompt is not None:
        text, special = req.prompt, True if req.add_special_tokens is None else req.add_special_tokens
    else:
        text, special = render_for_tokenize(req, template), bool(req.add_special_tokens)
    ids = tokenizer.encode(text, add_special_tokens=special).ids
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(req: DetokenizeRequest, tokenizer: Tokenizer | None, vocab_size: int) -> DetokenizeResponse:
    if tokenizer is None:
        raise PromptError("tokens", "this model directory has no tokenizer.json")
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise PromptError("tokens", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))
