"""Wire messages between relay's services. Every HTTP body and every Redis record is one of these.

Request models forbid unknown fields so a misspelt field is a 422 naming it, not a silent default,
and reject NaN and infinities (JSON as Python parses it allows them). The limits of what a request
may ask for live here once (the `Sampling*` types, `StopStrings`, ...), shared by /v1/generate and
the OpenAI routes, so a limit the engine relies on cannot be bypassed through another route.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WireRequest(Wire):
    """A request body: besides unknown fields, NaN and infinities are a 422 naming the field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---------------------------------------------------------------- sampling limits (every route)

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_SAMPLES = 1024
MAX_TOP_LOGPROBS = 64
# The OpenAI routes keep OpenAI's own, smaller limits on these two.
OPENAI_MAX_SAMPLES = 128
OPENAI_MAX_TOP_LOGPROBS = 20

Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False, description="0 means greedy")]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
# Drop tokens less likely than min_p times the most likely one (after temperature); 0 disables.
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
# Larger than what is left of the context is allowed: the sequence then ends with "length" there.
MaxTokens = Annotated[int, Field(gt=0)]
NumSamples = Annotated[int, Field(ge=1, le=MAX_SAMPLES, description="independent samples of the same prompt")]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
OpenAINumSamples = Annotated[int, Field(ge=1, le=OPENAI_MAX_SAMPLES)]
OpenAITopLogprobs = Annotated[int, Field(ge=0, le=OPENAI_MAX_TOP_LOGPROBS)]
StopTokenIds = Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


# ---------------------------------------------------------------- inference


class SamplingParams(WireRequest):
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = Field(0, ge=0, description="0 disables")
    min_p: MinP = 0.0
    max_tokens: MaxTokens = 16
    stop_token_ids: StopTokenIds = []
    # Stop strings, matched on the detokenised output as it is generated: the sequence ends with
    # finish_reason "stop" at the token that completes one, and `text` ends before it.
    stop: StopStrings = []
    ignore_eos: bool = False
    seed: int | None = None
    n: NumSamples = 1
    # Also return the n most likely ids and their log-probs at every sampled position.
    logprobs: TopLogprobs | None = None
    # Return the output text (GenerateChoice.text); implied by stop strings.
    detokenize: bool = False


class RoutedExperts(Wire):
    """MoE expert ids chosen per token and MoE layer: a [tokens, moe_layers, top_k] array, its
    little-endian bytes base64-encoded (pack/unpack: services/common/routing.py). The dtype's
    maximum value marks a token whose routing was not recorded."""

    dtype: Literal["uint8", "uint16"]
    shape: list[int] = Field(min_length=3, max_length=3)
    data: str


class GenerateRequest(WireRequest):
    """Token-in, token-out generation: what the orchestrator uses for rollouts."""

    input_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    request_id: str | None = None
    # MoE models: return the expert ids of every prompt and generated token (Router Replay)
    return_routed_experts: bool = False


class GenerateChoice(Wire):
    output_ids: list[int]
    # log-prob of each sampled token under the distribution it was sampled from: logits /
    # temperature, renormalised after top-k/top-p truncation (T=1 and no truncation: exactly
    # log_softmax(logits), what the trainer computes). Greedy (T=0): untruncated log_softmax.
    logprobs: list[float]
    # weight version that produced each token (weights can change mid-sequence)
    versions: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    # With sampling.logprobs = n: per output token, the n most likely [id, log-prob] pairs, most
    # likely first, under the model's untempered distribution log_softmax(logits).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With sampling.detokenize or stop strings: the decoded output (special tokens skipped),
    # ending before the stop string that finished it.
    text: str | None = None
    stop_str: str | None = None  # the stop string that ended the sequence, if one did
    # With return_routed_experts on an MoE model: one row per token of input_ids + output_ids
    # (the last output token was never forwarded, so its row is unrecorded).
    routed_experts: RoutedExperts | None = None


class GenerateResponse(Wire):
    request_id: str
    prompt_tokens: int
    choices: list[GenerateChoice]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False  # a last chunk with `usage` and no choices


class OpenAISampling(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (vLLM's extensions
    top_k, min_p, ignore_eos, stop_token_ids included), with SamplingParams' limits. Extra OpenAI
    fields are ignored; empty stop strings are dropped (OpenAI clients send them)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = Field(0, ge=-1)  # 0 or -1: disabled
    min_p: MinP = 0.0
    n: OpenAINumSamples = 1
    seed: int | None = None
    stop: (
        Annotated[str, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)
        ]
        | None
    ) = None
    stop_token_ids: StopTokenIds = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions for RL clients: the prompt's and each choice's token ids in the response
    # (`prompt_token_ids`, `choices[i].token_ids`), and log-prob tokens as "token_id:<id>".
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(OpenAISampling):
    """OpenAI /v1/completions subset."""

    prompt: str | list[int]
    max_tokens: MaxTokens = 16
    logprobs: OpenAITopLogprobs | None = None  # top-n log-probs per token

    @model_validator(mode="after")
    def _non_empty(self) -> CompletionRequest:
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


# Template variables a chat request sets from its own fields (services/common/chat.py renders them).
REQUEST_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def _no_request_variables(v: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(set(v) & REQUEST_TEMPLATE_VARIABLES)
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the request's own fields, not a template kwarg")
    return v


# Extra template variables, e.g. {"enable_thinking": false} for Qwen3 (vLLM's extension); the
# variables the request itself sets (messages, tools, add_generation_prompt) are refused.
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_no_request_variables)]


class ChatMessage(BaseModel):
    """One OpenAI chat message. Fields beyond role/content (tool_calls, tool_call_id, name,
    reasoning_content) pass through to the chat template unchanged."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(OpenAISampling):
    """OpenAI /v1/chat/completions subset: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    # None: up to the end of the context window
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: OpenAITopLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = {}
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; checked
    # against `tools` by services/decode/tool_calls.py (tool_choice_prefix).
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


class ChatCompletionTokensRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/tokens (the route verifiers' token client and prime-rl use):
    a chat request whose prompt is given as token ids, `tokens`, instead of being rendered from
    `messages` (which stay for the response's bookkeeping), so multi-turn rollouts continue from
    exactly the ids the engine produced."""

    tokens: list[int] = Field(min_length=1)


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: `prompt` text, or chat `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    # vLLM's defaults: BOS etc. for a text prompt, none for a rendered chat (the template has them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = {}
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class UpdateWeightsRequest(WireRequest):
    path: str = Field(min_length=1, description="a weights/step_N directory")
    version: int = Field(ge=0)


class WeightsInfo(Wire):
    version: int
    path: str
    published: float = Field(default_factory=time.time)


# ---------------------------------------------------------------- sandbox


class CreateSessionRequest(WireRequest):
    env: str = Field(min_length=1)
    seed: int = 0


class CreateSessionResponse(Wire):
    session_id: str
    env: str
    prompt: str
    max_turns: int


class CreateSessionsRequest(WireRequest):
    """n episodes of the same task (a rollout group) in one call."""

    env: str = Field(min_length=1)
    seed: int = 0
    n: int = Field(ge=1, le=1024)


class CreateSessionsResponse(Wire):
    sessions: list[CreateSessionResponse]


# Environment.credit(): per model turn, one value in [0, 1] per character of the action, then
# one for how the turn ended. None when the env gives only the episode reward.
Credit = list[list[Annotated[float, Field(ge=0.0, le=1.0)]]]


class StepRequest(WireRequest):
    action: str = Field(description="the model's turn, decoded, with the EOS token stripped")
    # False when the turn hit max_tokens instead of ending with EOS, so rewards can credit
    # only properly terminated answers.
    eos: bool = True


class StepResponse(Wire):
    observation: str
    done: bool
    # Filled when the step was sent with ?score=true and ended the episode: the session was
    # scored and closed in the same call (saves a round trip per episode).
    reward: float | None = Field(None, ge=0.0, le=1.0)
    credit: Credit | None = None


class SessionStep(WireRequest):
    session_id: str = Field(min_length=1, max_length=128)
    action: str = Field(description="the model's turn, decoded, with the EOS token stripped")
    eos: bool = True


class StepsRequest(WireRequest):
    """Several sessions' steps in one call (POST /v1/sessions/steps): a rollout group's turn."""

    steps: list[SessionStep] = Field(min_length=1, max_length=1024)


class StepResult(Wire):
    """One step of a batch, a line of its streamed answer: the index of the step in the request,
    its response, or the status and detail its own call would have answered with (one failing
    session does not fail the others)."""

    i: int
    response: StepResponse | None = None
    status: int = 200
    detail: str = ""


class ScoreResponse(Wire):
    reward: float = Field(ge=0.0, le=1.0)
    info: dict[str, float | int | str | bool] = {}
    credit: Credit | None = None


# ---------------------------------------------------------------- rollouts


class SampleSegment(Wire):
    """An earlier part of a sample's episode, closed when its history was trimmed
    (orchestrator.context_overflow = "trim_history"): the context the model generated those turns
    from, token-aligned like a Sample. The next part starts from the trimmed context."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    # model turns generated (and trained) in this part, and the episode's turn after which the
    # history was trimmed
    turns: int
    trimmed_after_turn: int
    reason: Literal["context_trim"] = "context_trim"
    routed_experts: RoutedExperts | None = None

    @model_validator(mode="after")
    def _aligned(self) -> SampleSegment:
        n = len(self.tokens)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError("segments: tokens, loss_mask, logprobs and versions must have the same length")
        if self.routed_experts is not None and self.routed_experts.shape[0] != n:
            raise ValueError("segments: routed_experts must have one row per token")
        return self


class Sample(Wire):
    """One finished rollout, token-aligned. tokens = prompt + (completion/observation turns).
    An episode whose history was trimmed has its earlier parts in `segments`; `tokens` is then
    its last part (the trimmed context and the turns after it)."""

    rollout_id: str
    tokens: list[int]
    # 1 where the policy sampled the token (trained), 0 for prompt and environment tokens.
    loss_mask: list[int]
    # inference log-prob per token (0.0 where loss_mask is 0)
    logprobs: list[float]
    # weight version per token (-1 where loss_mask is 0)
    versions: list[int]
    reward: float
    advantage: float = 0.0
    # Per-token advantages (orchestrator.advantage = "token"), one per token, 0.0 where loss_mask
    # is 0; when set, the trainer uses them instead of `advantage` on every token.
    token_advantages: list[float] | None = None
    turns: int = 1
    finish_reason: str = "stop"
    # MoE + Router Replay: the inference engine's expert ids for every token (one row per token)
    routed_experts: RoutedExperts | None = None
    # Earlier parts of the episode, oldest first (context_overflow = "trim_history"); each is
    # trained as its own sequence with this sample's advantage (`parts`).
    segments: list[SampleSegment] = []

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        n = len(self.tokens)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError("tokens, loss_mask, logprobs and versions must have the same length")
        if self.token_advantages is not None and len(self.token_advantages) != n:
            raise ValueError("token_advantages must have one value per token")
        if self.routed_experts is not None and self.routed_experts.shape[0] != n:
            raise ValueError("routed_experts must have one row per token")
        if self.segments and self.token_advantages is not None:
            raise ValueError("token_advantages: not combinable with segments (a trimmed history)")
        return self

    def parts(self) -> list[Sample]:
        """The sequences the trainer trains: each earlier segment (with this sample's reward and
        advantage), then this sample's own tokens. Every model token is in exactly one part, in
        the context it was generated from."""
        if not self.segments:
            return [self]
        earlier = [
            Sample.model_construct(
                rollout_id=f"{self.rollout_id}#{i}",
                tokens=seg.tokens,
                loss_mask=seg.loss_mask,
                logprobs=seg.logprobs,
                versions=seg.versions,
                reward=self.reward,
                advantage=self.advantage,
                token_advantages=None,
                turns=seg.turns,
                finish_reason=seg.reason,
                routed_experts=seg.routed_experts,
                segments=[],
            )
            for i, seg in enumerate(self.segments)
        ]
        rest = self.turns - sum(seg.turns for seg in self.segments)
        return [*earlier, self.model_copy(update={"segments": [], "turns": rest})]

    def advantages_per_token(self) -> list[float]:
        """The advantage of every token: token_advantages, or the sample's one advantage."""
        if self.token_advantages is not None:
            return self.token_advantages
        return [self.advantage] * len(self.tokens)

    @property
    def min_version(self) -> int:
        vs = [v for p in (self, *self.segments) for v, m in zip(p.versions, p.loss_mask, strict=True) if m]
        return min(vs) if vs else -1

    def all_versions(self) -> set[int]:
        """Every weight version any of the episode's tokens carries (all parts)."""
        return {v for p in (self, *self.segments) for v in p.versions}


class RolloutGroup(Wire):
    """One record on the rollout stream: the samples of one prompt, advantages filled in."""

    group_id: str
    env: str
    seed: int
    samples: list[Sample] = Field(min_length=1)
    created: float = Field(default_factory=time.time)

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples)

    @property
    def mean_reward(self) -> float:
        return sum(s.reward for s in self.samples) / len(self.samples)


class RolloutLogEntry(Wire):
    """One finished (pushed) or dropped group, as the rollout browser lists it (Redis stream
    `rollouts:log`, newest last): enough to find a rollout and open its transcript."""

    group_id: str
    env: str
    seed: int
    # Mean reward of the group's samples; None for a group dropped before it finished.
    reward: float | None = None
    # The oldest weight version that generated any of its tokens (-1: none, dropped before).
    min_version: int = -1
    samples: int = 0
    # Mean tokens per sample (prompt, model and environment), and mean model (trained) tokens.
    tokens: float = 0.0
    model_tokens: float = 0.0
    finished: float = Field(default_factory=time.time)

    @classmethod
    def of_group(cls, g: RolloutGroup) -> RolloutLogEntry:
        n = len(g.samples)
        return cls(
            group_id=g.group_id,
            env=g.env,
            seed=g.seed,
            reward=g.mean_reward,
            min_version=g.min_version,
            samples=n,
            tokens=sum(len(s.tokens) for s in g.samples) / n,
            model_tokens=sum(sum(s.loss_mask) for s in g.samples) / n,
        )


class RolloutFate(Wire):
    """Where a group ended up, from the ledger: trained (at which trainer version), dropped (why),
    or pending (on the stream or in flight: not trained or dropped yet)."""

    status: Literal["trained", "dropped", "pending"]
    # The trainer's version when it trained or dropped the group (staleness = this - min_version);
    # None when pending or dropped by the orchestrator.
    trainer_version: int | None = None
    reason: str = ""


class TrainerStepMetrics(Wire):
    """What the trainer reports after committing a step (Redis stream `metrics`)."""

    step: int
    version: int
    groups: int
    samples: int
    tokens: int
    loss: float
    entropy: float
    grad_norm: float
    reward: float
    reward_by_env: dict[str, float]
    staleness_mean: float
    staleness_max: int
    # groups of the step by staleness: staleness_groups[s] groups had trainer version - min_version = s
    staleness_groups: list[int] = []
    masked_ratio_frac: float
    dropped_stale: int
    wait_data_s: float
    step_s: float
    publish_s: float
    tokens_per_s: float
    loss_tokens: int = 0  # the tokens the loss covers (model-sampled; prompt and env tokens are not)
    sample_tokens_max: int = 0  # the step's longest sample (tokens / samples is the mean)
    entropy_coef: float = 0.0  # the entropy bonus's coefficient in this step (trainer/entropy.py)
    # Trainer/inference mismatch over the step's trained tokens (trainer/mismatch.py, docs/replay.md):
    # k3 KL(pi_infer || pi_train), max/mean |p_train - p_infer|, share of ratios outside [0.5, 2].
    mismatch_kl_k3: float = 0.0
    mismatch_p_abs_max: float = 0.0
    mismatch_p_abs_mean: float = 0.0
    mismatch_ratio_out_frac: float = 0.0
    # k3 over on-policy samples only (min_version == the trainer's version): the numerical
    # mismatch without policy lag (None: no such sample in the step)
    mismatch_kl_k3_on_policy: float | None = None
    # MoE only (empty / None for dense): per MoE layer, the share of recorded tokens whose trainer
    # top-k expert set equals inference's (None: the layer saw no recorded token), its token-weighted
    # mean, and the share of recorded (token, layer) pairs routed by the recorded ids (Router Replay).
    routing_agreement: list[float | None] = []
    routing_agreement_mean: float | None = None
    routing_replayed_frac: float | None = None
    # GLM-5 with trainer.dsa_indexer = "kl": the indexer's KL to the attention over its selected
    # keys, summed over layers, per query token (None: the indexer is frozen or absent).
    dsa_indexer_kl: float | None = None
    time: float = Field(default_factory=time.time)


# ---------------------------------------------------------------- control


class PauseRequest(Wire):
    """Body of the orchestrator's POST /v1/pause and /v1/resume (optional: no body is no reason)."""

    reason: str = Field("", max_length=500, description="why, shown in /v1/status and the run's log")


class PauseState(Wire):
    """The run's pause (Redis hash `control:pause`, services/common/bus.py): whether the
    orchestrator is paused, since when and why, and the seconds spent paused before the current
    pause. The run's time budget does not count paused time."""

    paused: bool = False
    since: float | None = None
    reason: str = ""
    total_s: float = 0.0

    def paused_s(self, now: float | None = None) -> float:
        """Seconds spent paused up to `now` (wall clock), the current pause included."""
        now = time.time() if now is None else now
        return self.total_s + (max(0.0, now - self.since) if self.since is not None else 0.0)


# ---------------------------------------------------------------- registry


class ServiceInfo(Wire):
    kind: str
    id: str
    url: str
    version: int = -1
    started: float = Field(default_factory=time.time)
    host: str = ""
    pid: int = 0


# Linux's limit on one argument of a command line (MAX_ARG_STRLEN, 32 pages) less its NUL: the
# command is one argument of /bin/sh -c.
MAX_COMMAND_BYTES = 32 * 4096 - 1
MAX_PATH_CHARS = 4096  # PATH_MAX
NO_NUL = r"^[^\x00]*$"  # a NUL cannot be part of a C string: an argument, a path
SandboxPath = Annotated[
    str, Field(min_length=1, max_length=MAX_PATH_CHARS, pattern=NO_NUL, description="relative to /work")
]


class ExecRequest(WireRequest):
    cmd: str = Field(
        min_length=1,
        pattern=NO_NUL,
        description=f"a shell command, run with /bin/sh -c in the session directory; at most "
        f"{MAX_COMMAND_BYTES} bytes as UTF-8, no NUL",
    )
    timeout_s: float | None = Field(None, gt=0, description="wall clock; default sandbox.exec_timeout_s")

    @field_validator("cmd")
    @classmethod
    def _fits_an_argument(cls, v: str) -> str:
        n = len(v.encode())
        if n > MAX_COMMAND_BYTES:
            raise ValueError(
                f"{n} bytes as UTF-8; one command line argument holds at most {MAX_COMMAND_BYTES}"
            )
        return v


class ExecResponse(Wire):
    exit_code: int = Field(description="the command's status; 128+N when killed by signal N")
    stdout: str
    stderr: str
    truncated: bool = Field(description="stdout or stderr went over sandbox.exec_output_bytes")
    timed_out: bool
    duration_s: float


class WriteFileRequest(WireRequest):
    path: SandboxPath
    content: str


class FileResponse(Wire):
    path: str
    content: str = ""
    truncated: bool = False
    bytes: int = 0


# ---------------------------------------------------------------- verifiers environments


class VerifiersGroupRequest(WireRequest):
    """POST /v1/verifiers/{env}/group: run one group of a verifiers environment's rollouts
    (example `seed % len(dataset)`, `n` times) against the decode replica at `decode_url`."""

    seed: int = 0
    n: int = Field(ge=1, le=1024)
    decode_url: str = Field(min_length=1)
    model: str = Field(min_length=1, description="the served model id (decode's run name)")
    sampling: SamplingParams = SamplingParams()


class VerifiersTurn(Wire):
    """One model call of a rollout, as decode returned it (return_token_ids)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    versions: list[int]  # the weight version that sampled each completion token
    truncated: bool = False  # cut by max_tokens (or the context)


class VerifiersRollout(Wire):
    turns: list[VerifiersTurn]
    reward: float
    metrics: dict[str, float] = {}
    stop_condition: str | None = None
    error: str | None = None  # the rollout ended on an error (reward as the rubric gave it)


class VerifiersGroupResponse(Wire):
    rollouts: list[VerifiersRollout]
