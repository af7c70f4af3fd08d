"""Frozen configuration records and their loading from configs/*.toml.

Owns: ModelConfig (architecture, from a model's metadata), EngineConfig (one engine),
ServerConfig (one HTTP server), FleetConfig (the whole process).

Invariants: every record is frozen and hashable (ModelConfig is a static jit argument);
validation happens in `__post_init__`, so an invalid record never exists; nothing here
imports jax or anything else of ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

API_KEY_ENV = "MULTISERVE_API_KEY"  # the API key when --api-key is not given

Architecture = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mistral",
                       "gemma2", "gemma3", "mixtral", "gpt_oss"]
# the model families behind multiserve/model/families (one module each; the registry there
# maps HF `architectures` / `model_type` to them)
ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe",
                                  "mistral", "gemma2", "gemma3", "mixtral", "gpt_oss")
HIDDEN_ACTS = ("silu", "gelu_tanh")  # the MLP gate's activation (ModelConfig.hidden_act)
SPECULATIVE_ALGORITHMS: tuple[str | None, ...] = (None, "ngram")
# the share of a reporting device's memory for weights + KV when mem_fraction_static is None
DEFAULT_MEM_FRACTION = 0.6
MOE_SHARDING = ("tensor", "expert")  # how an engine's device group splits the experts
# the most decode steps one dispatch may run (EngineConfig.decode_steps_per_dispatch)
MAX_DECODE_STEPS_PER_DISPATCH = 64


class ConfigError(ValueError):
    """A configuration value is invalid; `field` names it (dotted path)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"config field '{field_name}': {message}")
        self.field = field_name


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(field_name, message)


ROPE_TYPES = ("llama3", "linear", "yarn")  # the rope scalings RopeScaling describes


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling: "llama3" (its frequency bands: factor, low/high_freq_factor,
    original_max_position_embeddings), "linear" (every frequency divided by `factor`) or
    "yarn" (NTK-by-parts between interpolated and extrapolated frequencies, ramped over
    the dimensions between beta_fast and beta_slow rotations; cos and sin times
    `attention_factor`; GPT-OSS)."""

    factor: float
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        _require(self.rope_type in ROPE_TYPES, "rope_scaling.rope_type",
                 f"must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        _require(self.factor > 0, "rope_scaling.factor", f"must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """The static shape of a decoder of one of the model families (model/families): the
    dense fields every family has, and the mixture-of-experts fields (0 / () when dense).
    Hashable: used as a jit static arg."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # mixture of experts (qwen3_moe, qwen2_moe); 0 / () for dense families
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each routed expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum 1
    moe_layers: tuple[int, ...] = ()  # the sparse layers (the others run the dense MLP)
    shared_expert_intermediate_size: int = 0  # qwen2_moe: the sigmoid-gated shared expert
    # sliding-window attention (mistral, gemma): the layers in `sliding_layers` see the last
    # `sliding_window` keys of each query (transformers' kv > q - window); the others all
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # the sliding layers' own rope base, unscaled (gemma3's local layers); 0: theirs is
    # the global layers' (rope_theta with rope_scaling)
    rope_local_theta: float = 0.0
    # the attention scores' scale is query_pre_attn_scalar ** -0.5 (gemma); 0: head_dim's
    query_pre_attn_scalar: float = 0.0
    # soft caps (gemma2): attention scores and final logits become cap * tanh(s / cap); 0:
    # none
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # gemma: every RMSNorm scales by (1 + weight), in float32 before the rounding; each
    # block's output is normed again before the residual add (post-attention and
    # post-feed-forward norms); the embeddings are scaled by sqrt(hidden_size)
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    hidden_act: str = "silu"  # the MLP gate's activation (HIDDEN_ACTS)
    # gpt_oss: o_proj has a bias; each layer has one attention-sink logit per head; RMSNorm
    # scales by its weight in float32 before the rounding; the experts' SwiGLU clamps
    # gate and up at swiglu_limit and weighs the gate by sigmoid(swiglu_alpha * gate)
    o_proj_bias: bool = False
    attention_sinks: bool = False
    norm_weight_f32: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0

    def __post_init__(self) -> None:
        _require(self.architecture in ARCHITECTURES, "architecture",
                 f"unknown architecture {self.architecture!r}; supported: {ARCHITECTURES}")
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if self.num_experts:
            _require(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                     f"must be in 1..num_experts, got {self.num_experts_per_tok}")
            _require(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0")
            _require(all(0 <= i < self.num_layers for i in self.moe_layers)
                     and list(self.moe_layers) == sorted(set(self.moe_layers)), "moe_layers",
                     f"must be distinct ascending layer indexes, got {self.moe_layers}")
        else:
            _require(not self.moe_layers, "moe_layers", "needs num_experts > 0")
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        _require(all(0 <= i < self.num_layers for i in self.sliding_layers)
                 and list(self.sliding_layers) == sorted(set(self.sliding_layers)),
                 "sliding_layers", f"must be distinct ascending layer indexes, got "
                 f"{self.sliding_layers}")
        _require((self.sliding_window > 0) == bool(self.sliding_layers), "sliding_window",
                 f"must be > 0 exactly when some layer slides (got {self.sliding_window} "
                 f"for layers {self.sliding_layers})")
        _require(self.hidden_act in HIDDEN_ACTS, "hidden_act",
                 f"must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        _require(self.rope_local_theta >= 0 and self.query_pre_attn_scalar >= 0
                 and self.attn_logit_softcapping >= 0 and self.final_logit_softcapping >= 0,
                 "rope_local_theta", "rope_local_theta, query_pre_attn_scalar and the soft "
                 "caps must be >= 0")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, f"must be > 0, got {value!r}")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"num_heads ({self.num_heads}) must be a multiple of it ({self.num_kv_heads})")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def dense_mlp_layers(self) -> tuple[int, ...]:
        """The layers running the dense SwiGLU MLP (every layer of a dense family)."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    def layer_window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it sees every earlier key)."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def kv_window(self) -> int:
        """How many positions back from a query any layer reads, where every layer slides
        (the sliding window); 0 where some layer reads every earlier key. K/V further back
        than this is read by no layer: the engine may free its pages."""
        return self.sliding_window if len(self.sliding_layers) == self.num_layers else 0


@dataclass(frozen=True)
class EngineConfig:
    """One engine on one device group.

    `model_path=None` means the embedded default model (SmolLM2-135M-Instruct).
    `dtype="auto"`: the checkpoint's dtype where it runs well (bfloat16 on a CPU only where
    the native bfloat16 kernels run), else float32; the embedded default model float32
    (engine/base/dtype_choice.py says which and why).
    KV pool size: `max_total_tokens` if given, else `mem_fraction_static` (SGLang's
    flag; None: DEFAULT_MEM_FRACTION) of the device memory where the device reports it,
    else (CPU) the engine's share of the host's memory: `host_kv_mem_fraction` of it, at
    most `host_kv_max_tokens` tokens, or, where `mem_fraction_static` is given, that share
    of it less the weights, at most what `max_running_requests` full contexts need
    (engine/base/kv_sizing.py states the rule).

    Shape buckets: every step pads its token count to one of
    `precompile_token_paddings` (one compiled forward each) and its logits-row count to
    one of `precompile_bs_paddings` (one compiled lm_head + sampler each). The model is
    row-invariant at every size (model/invariance/primitives.py, model/layers/attention.py), so small buckets
    cost no determinism: a lone decode runs a 1-token, 1-row step.
    A decode step of b tokens and b logits rows, b in `fused_step_paddings` (None: every
    size in both lists) and b <= `fused_step_max` (None: any), runs as ONE compiled
    program (forward, head and sampler), checked bitwise against the two programs before
    it is used (engine/device/step_programs.py).
    `decode_steps_per_dispatch` K > 1: a decode-only step whose every row needs no
    per-token host decision runs K decode steps in ONE compiled loop (a program per fused
    step size: `fused_step_paddings` and `fused_step_max` bound both), each step the fused
    step's computation, bitwise what K single steps give;
    checked against K single steps when primed (engine/device/step_programs.py).
    Otherwise (K = 1, or some row has a penalty, a grammar or min_new_tokens still ahead,
    or prompt chunks share the step) the step is a single step.
    """

    model_path: str | None = None
    device_indexes: tuple[int, ...] = (0,)
    dtype: str = "auto"
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    # CPU pools (the host reports no device memory): this fraction of the host's memory,
    # split over the process's devices, at most `host_kv_max_tokens` tokens per engine
    # (engine/base/kv_sizing.py)
    host_kv_mem_fraction: float = 0.1
    host_kv_max_tokens: int = 32768
    max_running_requests: int = 128
    # Admission bounds of the waiting queue (engine/sched/admission.py): samples, and KV tokens
    # the waiting samples will need (None: 32 x the KV pool). Beyond them: 429 / 503.
    max_queued_requests: int = 1024
    max_queued_tokens: int | None = None
    max_context_len: int | None = 4096
    chunked_prefill_size: int = 512
    precompile_token_paddings: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    precompile_bs_paddings: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    # sizes b whose b-token, b-row steps run as one fused program; None: every size in both
    # paddings lists; (): none (every step runs a forward program and a head program)
    fused_step_paddings: tuple[int, ...] | None = None
    # only sizes up to this one are fused, whichever list they come from (None: no bound):
    # a bound stays valid when the paddings lists change, where an explicit list may not
    fused_step_max: int | None = None
    # decode steps one dispatch runs in a compiled loop (1: one step per dispatch); where
    # the loop runs and what stays the same: the class docstring
    decode_steps_per_dispatch: int = 1
    attention_block_size: int = 128
    # how a MoE model's experts are split over the engine's device group: "tensor" (each
    # expert's intermediate dim) or "expert" (the experts); ignored by dense models
    moe_sharding: str = "tensor"
    disable_overlap: bool = False
    disable_prefix_cache: bool = False
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    seed: int = 0
    weight_version: str = "default"
    served_model_name: str | None = None
    warmup: bool = True
    # Serve once the programs covering every step shape are compiled (the largest
    # buckets); compile the smaller, faster ones on a background thread while serving
    # (engine/device/programs.py). Outputs are identical (the model is row-invariant at
    # every bucket); only speed differs until every program is compiled. False: the
    # engine starts serving with every bucket compiled.
    compile_in_background: bool = True
    show_progress: bool = True
    # How each row-invariant primitive computes each step size (a
    # model.invariance_plan.InvariancePlan). None: calibrated on the machine at start-up
    # (model/invariance/calibration.py, cached per backend); a plan given here is used as is.
    invariance_plan: Any = None
    # Speculative decoding (engine/spec/): "ngram" drafts from the request's own prompt and
    # output and from earlier outputs of the same prompt; every draft token is checked
    # against the token the request's own sampler draws at its position, so outputs are
    # those without speculation, bit for bit. None: off. `speculative_num_draft_tokens`:
    # the most draft tokens of one request in one step; `speculative_max_step_tokens`: a
    # step carries draft tokens only while its tokens (drafts included) stay within it;
    # within that, the measured cost of each token bucket decides (engine/spec/step_costs).
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 8
    speculative_max_step_tokens: int = 64
    # LoRA adapters (model/layers/lora.py): how many adapters the engine holds at once
    # (0: no LoRA, the engine compiles exactly the programs it compiles without it) and
    # the largest rank one may have (smaller ranks are zero-padded to it)
    max_loras_per_batch: int = 0
    max_lora_rank: int = 16
    # PEFT adapter directories loaded at start, "name=path" (or a bare path: named by it)
    lora_paths: tuple[str, ...] = ()
    # Routing replay (SGLang's --enable-return-routed-experts): a MoE model's steps also
    # return the top-k expert ids of every token in every MoE layer, so requests may ask
    # for them (`return_routed_experts`). False: the step programs are those of an engine
    # without the feature (same programs, same compile-cache keys) and such requests are
    # refused. Ignored by dense models (which refuse the requests).
    enable_return_routed_experts: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_indexes", tuple(self.device_indexes))
        object.__setattr__(self, "precompile_token_paddings",
                           tuple(sorted(set(self.precompile_token_paddings))))
        object.__setattr__(self, "precompile_bs_paddings",
                           tuple(sorted(set(self.precompile_bs_paddings))))
        if self.fused_step_paddings is not None:
            object.__setattr__(self, "fused_step_paddings",
                               tuple(sorted(set(self.fused_step_paddings))))
        _require(len(self.device_indexes) >= 1, "device_indexes", "needs at least one device")
        _require(len(set(self.device_indexes)) == len(self.device_indexes), "device_indexes",
                 f"repeats a device: {list(self.device_indexes)}")
        _require(all(isinstance(i, int) and i >= 0 for i in self.device_indexes),
                 "device_indexes", "must be non-negative integers")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
                 "page_size", f"must be a power of two, got {self.page_size}")
        _require(self.max_total_tokens is None or self.max_total_tokens >= self.page_size * 4,
                 "max_total_tokens", "too small for even a few pages")
        _require(self.mem_fraction_static is None or 0.0 < self.mem_fraction_static < 1.0,
                 "mem_fraction_static", "must be in (0, 1)")
        _require(0.0 < self.host_kv_mem_fraction < 1.0, "host_kv_mem_fraction",
                 "must be in (0, 1)")
        _require(self.host_kv_max_tokens >= self.page_size * 4, "host_kv_max_tokens",
                 "too small for even a few pages")
        _require(self.max_running_requests >= 1, "max_running_requests", "must be >= 1")
        _require(self.max_queued_requests >= 1, "max_queued_requests", "must be >= 1")
        _require(self.max_queued_tokens is None or self.max_queued_tokens >= 1,
                 "max_queued_tokens", "must be >= 1 (or unset: 32 x the KV pool)")
        _require(bool(self.precompile_token_paddings), "precompile_token_paddings",
                 "needs at least one size")
        _require(bool(self.precompile_bs_paddings), "precompile_bs_paddings",
                 "needs at least one size")
        _require(max(self.precompile_bs_paddings) >= self.max_running_requests,
                 "precompile_bs_paddings",
                 f"largest ({max(self.precompile_bs_paddings)}) must cover "
                 f"max_running_requests ({self.max_running_requests})")
        _require(self.chunked_prefill_size <= max(self.precompile_token_paddings),
                 "chunked_prefill_size",
                 f"must be <= the largest token padding ({max(self.precompile_token_paddings)})")
        both = self._paddings_in_both()
        _require(self.fused_step_paddings is None or set(self.fused_step_paddings) <= set(both),
                 "fused_step_paddings",
                 f"each size must be in both precompile_token_paddings and "
                 f"precompile_bs_paddings (sizes in both: {list(both)})")
        _require(self.fused_step_max is None or self.fused_step_max >= 1, "fused_step_max",
                 "must be >= 1 (or unset: no bound)")
        _require(self.chunked_prefill_size >= 1, "chunked_prefill_size", "must be >= 1")
        _require(1 <= self.decode_steps_per_dispatch <= MAX_DECODE_STEPS_PER_DISPATCH,
                 "decode_steps_per_dispatch",
                 f"must be in [1, {MAX_DECODE_STEPS_PER_DISPATCH}], "
                 f"got {self.decode_steps_per_dispatch}")
        _require(self.max_loras_per_batch >= 0, "max_loras_per_batch", "must be >= 0")
        _require(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths))
        _require(len(self.lora_paths) <= self.max_loras_per_batch, "lora_paths",
                 f"{len(self.lora_paths)} adapter(s) need max_loras_per_batch >= that "
                 f"(it is {self.max_loras_per_batch})")
        _require(all(isinstance(p, str) and p and not p.startswith("=")
                     and not p.endswith("=") for p in self.lora_paths), "lora_paths",
                 "each entry is name=path or a path")
        _require(self.attention_block_size % self.page_size == 0
                 or self.page_size % self.attention_block_size == 0,
                 "attention_block_size", "must be a multiple or divisor of page_size")
        _require(0.0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0,
                 "init_new_token_ratio", "need 0 <= min_new_token_ratio <= it <= 1")
        _require(self.moe_sharding in MOE_SHARDING, "moe_sharding",
                 f"must be one of {MOE_SHARDING}, got {self.moe_sharding!r}")
        _require(self.speculative_algorithm in SPECULATIVE_ALGORITHMS, "speculative_algorithm",
                 f"must be one of {SPECULATIVE_ALGORITHMS}, got {self.speculative_algorithm!r}")
        _require(1 <= self.speculative_num_draft_tokens <= 16, "speculative_num_draft_tokens",
                 f"must be in [1, 16], got {self.speculative_num_draft_tokens}")
        _require(self.speculative_algorithm is None or
                 2 <= self.speculative_max_step_tokens <= max(self.precompile_token_paddings),
                 "speculative_max_step_tokens", "must be in [2, the largest token padding]")

    @property
    def fused_step_sizes(self) -> tuple[int, ...]:
        """The sizes whose decode steps run one fused program (`fused_step_paddings`
        resolved: None is every size in both paddings lists), up to `fused_step_max`."""
        sizes = (self.fused_step_paddings if self.fused_step_paddings is not None
                 else self._paddings_in_both())
        if self.fused_step_max is not None:
            return tuple(b for b in sizes if b <= self.fused_step_max)
        return sizes

    @property
    def decode_steps_sizes(self) -> tuple[int, ...]:
        """The sizes whose decode steps may run `decode_steps_per_dispatch` steps in one
        dispatch: the fused step sizes while it is above 1, else none."""
        return self.fused_step_sizes if self.decode_steps_per_dispatch > 1 else ()

    def _paddings_in_both(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.precompile_token_paddings)
                            & set(self.precompile_bs_paddings)))

    def with_updates(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)


# A request body larger than this is refused (413) before it is parsed: room for a batch
# of long token-id prompts, far below what would cost seconds of parsing and tokenizing.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """One HTTP server (in front of one engine, or the supervisor)."""

    host: str = "127.0.0.1"
    port: int = 31000
    # Bodies above this many bytes get a 413 before they are parsed (server/body_limit.py).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # sglang's server argument, reported as set by /get_server_info (slime's external-engine
    # check compares it with its offload_rollout). Memory release and resume
    # (/release_memory_occupation) work either way.
    enable_memory_saver: bool = False
    # Engine servers: the tool-call format read from replies (a multiserve.parsing
    # TOOL_PARSERS name; None: chosen from the chat template), the reasoning split
    # (REASONING_PARSERS name; None: none), and a Jinja chat template file that replaces
    # the model's own (None: the model's).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        from multiserve.parsing import REASONING_PARSERS, TOOL_PARSERS  # plain Python

        _require(self.tool_call_parser is None or self.tool_call_parser in TOOL_PARSERS,
                 "tool_call_parser", f"must be one of {sorted(TOOL_PARSERS)}, got "
                 f"{self.tool_call_parser!r}")
        _require(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS,
                 "reasoning_parser", f"must be one of {sorted(REASONING_PARSERS)}, got "
                 f"{self.reasoning_parser!r}")
        _require(self.chat_template is None or (isinstance(self.chat_template, str)
                                                and self.chat_template != ""),
                 "chat_template", f"must be a file path, got {self.chat_template!r}")
        _require(isinstance(self.port, int) and 0 <= self.port < 65536, "port",
                 f"must be in [0, 65535], got {self.port!r}")
        _require(isinstance(self.max_request_bytes, int)
                 and not isinstance(self.max_request_bytes, bool)
                 and self.max_request_bytes >= 1024, "max_request_bytes",
                 f"must be an integer >= 1024, got {self.max_request_bytes!r}")
        _require(isinstance(self.enable_memory_saver, bool), "enable_memory_saver",
                 f"must be true or false, got {self.enable_memory_saver!r}")


@dataclass(frozen=True)
class RoutingConfig:
    """How the fleet's front door (fleet/front_door.py, fleet/routing.py) picks an engine:
    sticky by session, else the longest prefix sent to an engine when it covers
    `cache_threshold` of the prompt and the load is balanced (in-flight requests differ
    by at most `balance_abs_threshold`, or the busiest has at most
    `balance_rel_threshold` times the idlest's), else the least loaded. Prompt keys are
    indexed in `chunk_chars`-character chunks, at most `index_chunks` per engine; at most
    `max_sessions` sessions are pinned (least recently used forgotten first). A request
    finding no engine that takes work (all paused, asleep or unhealthy) waits up to
    `wait_s` for one, then gets 503."""

    cache_threshold: float = 0.3  # sglang-router 0.3.2's default
    balance_abs_threshold: int = 4  # requests in flight (sglang-router's default: 64)
    balance_rel_threshold: float = 1.5  # sglang-router's default
    chunk_chars: int = 64
    index_chunks: int = 65536
    max_sessions: int = 100_000
    wait_s: float = 600.0

    def __post_init__(self) -> None:
        _require(0.0 <= self.cache_threshold <= 1.0, "routing.cache_threshold",
                 f"must be in [0, 1], got {self.cache_threshold!r}")
        _require(self.balance_abs_threshold >= 0, "routing.balance_abs_threshold",
                 "must be >= 0")
        _require(self.balance_rel_threshold >= 1.0, "routing.balance_rel_threshold",
                 "must be >= 1")
        for name in ("chunk_chars", "index_chunks", "max_sessions"):
            _require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                     f"routing.{name}", "must be an integer >= 1")
        _require(self.wait_s >= 0, "routing.wait_s", "must be >= 0")


@dataclass(frozen=True)
class MultiHostConfig:
    """Where this process stands in a slice of several hosts (multiserve/multihost/).

    SGLang's names: `nnodes` hosts, this one `node_rank` (0 leads), the JAX coordinator
    at `dist_init_addr` ("HOST:PORT", served by node 0). The leader's step stream listens
    on the coordinator's port + 1 (`stream_port`). nnodes == 1 is the one-host server
    exactly (nothing starts)."""

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # a follower that sends nothing (no ack, no heartbeat) for this long is dead
    heartbeat_timeout_s: float = 10.0
    # every host must have joined within this long of the leader starting
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _require(isinstance(self.nnodes, int) and not isinstance(self.nnodes, bool)
                 and self.nnodes >= 1, "nnodes", f"must be an integer >= 1, got {self.nnodes!r}")
        _require(isinstance(self.node_rank, int) and not isinstance(self.node_rank, bool)
                 and 0 <= self.node_rank < self.nnodes, "node_rank",
                 f"must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1:
            _require(self.dist_init_addr is not None, "dist_init_addr",
                     "is required with nnodes > 1 (HOST:PORT of node 0's coordinator)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            _require(bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65535,
                     "dist_init_addr", f"must be HOST:PORT with a port in [1, 65534] (the step "
                     f"stream takes PORT + 1), got {self.dist_init_addr!r}")
        _require(self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", "must be > 0")
        _require(self.startup_timeout_s > 0, "startup_timeout_s", "must be > 0")

    @property
    def enabled(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def host(self) -> str:
        assert self.dist_init_addr is not None
        return self.dist_init_addr.rpartition(":")[0].strip("[]")

    @property
    def coordinator_port(self) -> int:
        assert self.dist_init_addr is not None
        return int(self.dist_init_addr.rpartition(":")[2])

    @property
    def stream_port(self) -> int:
        """The leader's step stream (followers connect to it)."""
        return self.coordinator_port + 1


@dataclass(frozen=True)
class FleetConfig:
    """The whole process: one engine (and one server) per device group, plus a supervisor."""

    engines: tuple[EngineConfig, ...]
    servers: tuple[ServerConfig, ...]
    supervisor: ServerConfig = field(default_factory=lambda: ServerConfig(port=31100))
    platform: str = "auto"  # "cpu" sets the virtual device count before JAX starts
    warmup_parallel: bool = False
    # Every engine and supervisor endpoint requires `Authorization: Bearer <api_key>` when
    # set (server/auth.py); never printed (repr=False).
    api_key: str | None = field(default=None, repr=False)
    # one engine across several hosts (multiserve/multihost/); the default: this host alone
    multihost: MultiHostConfig = field(default_factory=MultiHostConfig)
    # one OpenAI/SGLang port for the whole fleet (fleet/front_door.py; None: none), and
    # how it routes; the engine ports and the supervisor stay
    front_door: ServerConfig | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def __post_init__(self) -> None:
        _require(len(self.engines) >= 1, "engines", "needs at least one engine")
        _require(len(self.engines) == len(self.servers), "servers",
                 "one server per engine")
        seen: dict[int, int] = {}
        for i, eng in enumerate(self.engines):
            for d in eng.device_indexes:
                _require(d not in seen, f"engines[{i}].device_indexes",
                         f"device {d} is already used by engines[{seen.get(d)}]")
                seen[d] = i
        ports = [s.port for s in self.servers if s.port != 0]
        for extra in (self.supervisor, self.front_door):
            if extra is not None and extra.port != 0:
                ports.append(extra.port)
        dup = sorted({p for p in ports if ports.count(p) > 1})
        _require(not dup, "servers.port", f"port clash on {dup}")
        _require(self.api_key is None or (isinstance(self.api_key, str) and self.api_key != ""
                                          and self.api_key.strip() == self.api_key),
                 "api_key", "must be a non-empty string without surrounding spaces")

    @property
    def device_count_needed(self) -> int:
        return 1 + max(d for e in self.engines for d in e.device_indexes)
