"""Frozen configuration dataclasses, one per concern, gathered in EngineConfig."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from kvferry.cache_dir import default_cache_dir
from kvferry.errors import ConfigError
from kvferry.json_flags import json_object, parse_json_flag
from kvferry.kv.shared_pool import KVPoolSpec
from kvferry.kv.spec import KVAllocator, Layout
from kvferry.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # torch only types ModelConfig.dtype: launchers and the proxy never import it
    import torch


class WeightQuantization(str, Enum):
    """How linear weights are stored (--quantization)."""

    NONE = "none"  # the model's dtype
    INT4 = "int4"  # weight-only int4 in groups of 32, bf16 scales and zeros (CPU)
    GGUF = "gguf"  # a GGUF checkpoint's Q4_0/Q4_1/Q8_0 blocks kept and multiplied as stored (CPU)

    def __str__(self) -> str:
        return self.value


class MLAForm(str, Enum):
    """How multi-head latent attention computes a phase (--mla-prefill, --mla-decode;
    kvferry.model.layers.mla)."""

    ABSORBED = "absorbed"  # kv_b_proj folded into queries and outputs: one query set over the rows
    DECOMPRESSED = "decompressed"  # the context's rows expanded to per-head keys and values

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class MLAForms:
    """The form of each phase. Defaults: the faster of the two on a 2-vCPU AVX2 EPYC for a
    DeepSeek-V2-Lite layer (docs/benchmarks.md, "MLA: absorbed or decompressed")."""

    prefill: MLAForm = MLAForm.DECOMPRESSED
    decode: MLAForm = MLAForm.ABSORBED

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", _member(MLAForm, self.prefill, "MLA prefill form"))
        object.__setattr__(self, "decode", _member(MLAForm, self.decode, "MLA decode form"))


@dataclass(frozen=True)
class ModelConfig:
    """What the model is: resolved from a local dir, a hub id in the HF cache, or a GGUF file."""

    model: str
    served_model_name: str
    architecture: str
    hf_config: object  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # KV heads the cache stores (a latent-attention model: 1, its latent row)
    head_dim: int  # their size (latent attention: half the row, kvferry.kv.spec.LatentAttentionSpec)
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    gguf_file: str | None = None  # set when the weights come from a GGUF file
    local_dir: str | None = None  # directory holding config/tokenizer/weights
    # --quantization: how linear weights are stored (kvferry.model.layers.int4); "int4" coerced
    quantization: WeightQuantization = WeightQuantization.NONE
    mla_forms: MLAForms = field(default_factory=MLAForms)  # latent-attention models only

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", weight_quantization(self.quantization))


def weight_quantization(value: WeightQuantization | str | None) -> WeightQuantization:
    """`value` ("none", "int4", "gguf" or a member) as a WeightQuantization, or a ConfigError.
    None is "none", as `LLM(model, quantization=None)` means in vLLM."""
    if value is None:
        return WeightQuantization.NONE
    return _member(WeightQuantization, value, "quantization")


E = TypeVar("E", bound=Enum)


def _member(enum: type[E], value: object, what: str) -> E:
    """`value` as a member of a str-valued `enum`, or a ConfigError listing the choices."""
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(m.value for m in enum)
        raise ConfigError(f"unknown {what} {value!r}; choose one of {choices}") from None


def _at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, not {value!r}")


# Share of the memory left after weights and the measured activation peak that the KV
# cache takes when no size is asked for: small, because CPU hosts are shared.
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.1


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes of KV cache per rank (--kv-cache-memory). None: kv_cache_memory_fraction of
    # the memory available after weights and the profiled activation peak.
    kv_cache_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    layout: Layout = Layout.NHD  # the spelling "NHD"/"HND" is accepted and coerced
    kv_cache_memory_fraction: float = DEFAULT_KV_CACHE_MEMORY_FRACTION
    kv_allocator: KVAllocator = KVAllocator.EAGER  # --kv-allocator; "eager"/"elastic" coerced
    # --kv-memory-pool NAME [--kv-pool-size SIZE]: elastic pages drawn from a budget shared
    # by the engines of this host (kvferry.kv.shared_pool); the size creates the pool.
    kv_memory_pool: KVPoolSpec | None = None

    def __post_init__(self) -> None:
        _at_least_one("block_size", self.block_size)
        object.__setattr__(self, "layout", _member(Layout, self.layout, "KV layout"))
        object.__setattr__(self, "kv_allocator", _member(KVAllocator, self.kv_allocator, "KV allocator"))
        if self.kv_memory_pool is not None and self.kv_allocator is not KVAllocator.ELASTIC:
            raise ConfigError("--kv-memory-pool needs --kv-allocator elastic")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction must be in (0, 1], not {self.kv_cache_memory_fraction}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"the KV cache size must be positive, not {self.kv_cache_bytes} bytes")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # --prefill-budget-with-decodes: while requests are decoding, the prompt tokens one step
    # may compute (chunked prefill), so a long prompt does not stall their next tokens for
    # a whole max_num_batched_tokens step. A budget at or above max_num_batched_tokens caps
    # nothing. The default: a 1,000-token prompt arriving while a request decodes stalls it
    # for one 1,000-token step without a budget and for at most a 256-token chunk with
    # this one, for +3% on the prompt's own compute (docs/benchmarks.md, "Prefill budget").
    prefill_budget_with_decodes: int = 256
    # --default-max-tokens: the output tokens of a request that sets no max_tokens (chat's
    # null or absent). None: up to the end of the model's context, as vLLM; a chat answer
    # may then take minutes.
    default_max_tokens: int | None = None

    def __post_init__(self) -> None:
        _at_least_one("max_num_batched_tokens", self.max_num_batched_tokens)
        _at_least_one("max_num_seqs", self.max_num_seqs)
        _at_least_one("the prefill budget with decodes", self.prefill_budget_with_decodes)
        if self.default_max_tokens is not None:
            _at_least_one("default_max_tokens", self.default_max_tokens)

    @property
    def caps_prefill_with_decodes(self) -> bool:
        """True when a step with decodes computes fewer prompt tokens than one without."""
        return self.enable_chunked_prefill and self.prefill_budget_with_decodes < self.max_num_batched_tokens


class ExecutorKind(str, Enum):
    """How an engine reaches its workers (kvferry.executor)."""

    UNIPROC = "uniproc"  # one worker in the engine's process (TP=1)
    MULTIPROC = "multiproc"  # one process per rank
    RAY = "ray"  # one Ray actor per rank

    def __str__(self) -> str:
        return self.value


class MoEParallel(str, Enum):
    """How the tensor-parallel ranks split a mixture-of-experts layer's routed experts
    (kvferry.model.moe); shared experts and dense layers are tensor-parallel either way."""

    TENSOR = "tensor"  # each rank a slice of every expert's intermediate features
    EXPERT = "expert"  # each rank num_experts / tp whole experts

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    executor: ExecutorKind = ExecutorKind.UNIPROC  # TP > 1 with uniproc runs multiproc
    moe_parallel: MoEParallel = MoEParallel.TENSOR  # --moe-parallel (docs/benchmarks.md)
    # CPU placement (kvferry.worker.cpu_placement): the cores this instance pins its ranks
    # to (None: not pinned) and torch threads per rank (None: one per core of the rank).
    cpu_cores: tuple[int, ...] | None = None
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        _at_least_one("tensor_parallel_size", self.tensor_parallel_size)
        object.__setattr__(self, "executor", _member(ExecutorKind, self.executor, "executor"))
        object.__setattr__(self, "moe_parallel", _member(MoEParallel, self.moe_parallel, "MoE parallelism"))
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be at least 1, not {self.cpu_threads}")
        if self.cpu_cores is not None and len(self.cpu_cores) < self.tensor_parallel_size:
            raise ConfigError(
                f"{len(self.cpu_cores)} CPU cores cannot give each of "
                f"{self.tensor_parallel_size} TP ranks one"
            )


class KVRole(str, Enum):
    """What an engine does with remote KV: produce it (prefill), consume it (decode), or both."""

    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"

    def __str__(self) -> str:
        return self.value


class LoadFailurePolicy(str, Enum):
    """What the scheduler does when loading a request's KV failed (invariant 6)."""

    FAIL = "fail"  # the request ends with an error to the client
    RECOMPUTE = "recompute"  # its KV is computed locally

    def __str__(self) -> str:
        return self.value


# The accepted spellings (a str-valued enum member compares equal to its value).
KV_ROLES = tuple(r.value for r in KVRole)
LOAD_FAILURE_POLICIES = tuple(p.value for p in LoadFailurePolicy)


@dataclass(frozen=True)
class KVTransferConfig:
    """--kv-transfer-config: which connector, in which role, with what settings."""

    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_role: KVRole = KVRole.BOTH
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.FAIL

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role must be one of {KV_ROLES}, not {self.kv_role!r}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}")
        object.__setattr__(self, "kv_role", KVRole(self.kv_role))
        object.__setattr__(self, "kv_load_failure_policy", LoadFailurePolicy(self.kv_load_failure_policy))

    @property
    def enabled(self) -> bool:
        return self.kv_connector is not None

    @classmethod
    def from_dict(cls, raw: object) -> KVTransferConfig:
        config = cls(**json_object(raw, "--kv-transfer-config", cls.__dataclass_fields__))
        config.validate()
        return config

    def validate(self) -> None:
        if self.kv_connector is not None and not isinstance(self.kv_connector, str):
            raise ConfigError("kv_connector must be a string")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")


@dataclass(frozen=True)
class ConnectorSpec:
    """The KV connector resolved once per process (kvferry.connector.factory.resolve_connector):
    its class, checked against the connector API, the role and the KV layout; its transfer
    settings with the start-up decisions every half and rank shares (an engine id, a port);
    and, for a connector made of others (MultiConnector), theirs. The engine, the executor,
    the workers and the front end read this; nothing resolves the connector again."""

    # a kvferry.connector.base.KVConnectorBase subclass (that layer narrows it:
    # kvferry.connector.base.connector_class)
    connector_class: type
    transfer: KVTransferConfig
    children: tuple[ConnectorSpec, ...] = ()

    def walk(self) -> Iterator[ConnectorSpec]:
        """This spec and its children's, depth first."""
        yield self
        for child in self.children:
            yield from child.walk()


class CaptureMode(str, Enum):
    """Whether decode steps run as one compiled program (--capture; kvferry.worker.capture)."""

    AUTO = "auto"  # compiled where it measured faster than eager at start-up (the default)
    ALWAYS = "always"  # compiled, not measured
    NEVER = "never"  # every forward eager (--enforce-eager)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CompilationConfig:
    """The captured forward (kvferry.worker.capture). `enforce_eager` is vLLM's name for
    `capture=NEVER`, kept in step with it: setting either sets both."""

    capture: CaptureMode = CaptureMode.AUTO
    enforce_eager: bool = False
    # Where --capture auto's decision and the compiled programs are kept across starts
    # (kvferry.engine.capture_cache); None: nothing is kept, every start decides anew.
    cache_dir: str | None = field(default_factory=lambda: str(default_cache_dir()))

    def __post_init__(self) -> None:
        capture = _member(CaptureMode, self.capture, "capture mode")
        if self.enforce_eager and capture is CaptureMode.ALWAYS:
            raise ConfigError("--enforce-eager contradicts --capture always")
        if self.enforce_eager:
            capture = CaptureMode.NEVER
        object.__setattr__(self, "capture", capture)
        object.__setattr__(self, "enforce_eager", capture is CaptureMode.NEVER)


@dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config (vLLM's keys). The PUB socket binds when the endpoint has a
    wildcard (`tcp://*:5557`) or is ipc/inproc, else connects; the ROUTER replay socket
    binds (`"bind": true` makes a loopback PUB endpoint bind too). `buffer_steps` batches stay for replay; `max_queue_size` batches wait for the
    publisher thread, beyond that the engine drops them (counted, never blocking a step)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool | None = None  # kvferry's: bind (True) or connect the PUB socket; None: as vLLM decides

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(
                f"--kv-events-config: publisher must be 'zmq' or 'null', not {self.publisher!r}"
            )
        sizes = (
            ("buffer_steps", self.buffer_steps),
            ("hwm", self.hwm),
            ("max_queue_size", self.max_queue_size),
        )
        for name, value in sizes:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--kv-events-config: {name} must be a positive integer, not {value!r}")
        if not isinstance(self.endpoint, str) or not isinstance(self.topic, str):
            raise ConfigError("--kv-events-config: endpoint and topic must be strings")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ConfigError("--kv-events-config: replay_endpoint must be a string")

    @property
    def enabled(self) -> bool:
        """Whether the engine records and publishes events (vLLM: both keys must say so)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, raw: str | None) -> KVEventsConfig:
        if raw is None:
            return cls()
        flag = "--kv-events-config"
        return cls(**json_object(parse_json_flag(raw, flag), flag, [f.name for f in fields(cls)]))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # --kv-events-config
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # --speculative-config
    device: str = "cpu"
    seed: int = 0
    # Set by kvferry.connector.factory.resolve_connector (kv_transfer then holds the settled
    # settings, the same as connector.transfer); None without a connector or before it.
    connector: ConnectorSpec | None = None


@dataclass(frozen=True)
class EngineOptions:
    """What a user may set, flat: `LLM(model, **options)`'s keywords and `kvferry serve`'s
    flags both become one of these, and `engine_config` is the one place that turns them
    into an EngineConfig. Each default is the config dataclass's own (stated once, above)."""

    model: str
    dtype: str = "auto"  # kvferry.config.parse_dtype
    quantization: WeightQuantization = ModelConfig.quantization  # "int4" coerced, as below
    max_model_len: int | None = None  # None: the checkpoint's
    served_model_name: str | None = None  # None: `model` as given
    block_size: int = CacheConfig.block_size
    kv_cache_bytes: int | None = CacheConfig.kv_cache_bytes
    kv_cache_memory_fraction: float = CacheConfig.kv_cache_memory_fraction
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    kv_layout: Layout = CacheConfig.layout
    kv_allocator: KVAllocator = CacheConfig.kv_allocator
    kv_memory_pool: KVPoolSpec | None = CacheConfig.kv_memory_pool
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    prefill_budget_with_decodes: int = SchedulerConfig.prefill_budget_with_decodes
    default_max_tokens: int | None = SchedulerConfig.default_max_tokens
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    executor: ExecutorKind = ParallelConfig.executor
    moe_parallel: MoEParallel = ParallelConfig.moe_parallel  # "expert" coerced
    cpu_cores: tuple[int, ...] | None = ParallelConfig.cpu_cores
    cpu_threads: int | None = ParallelConfig.cpu_threads
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    capture: CaptureMode = CompilationConfig.capture  # "always" etc. coerced
    enforce_eager: bool = CompilationConfig.enforce_eager  # capture=NEVER, vLLM's name
    cache_dir: str | None = field(default_factory=lambda: CompilationConfig().cache_dir)  # --cache-dir
    seed: int = EngineConfig.seed
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    mla_prefill: MLAForm = MLAForms.prefill  # "decompressed" etc. coerced (latent attention only)
    mla_decode: MLAForm = MLAForms.decode
    # a dict of vLLM's keys (or the flag's JSON) coerced: {"method": "ngram", ...}
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization", weight_quantization(self.quantization))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        object.__setattr__(self, "mla_prefill", _member(MLAForm, self.mla_prefill, "MLA prefill form"))
        object.__setattr__(self, "mla_decode", _member(MLAForm, self.mla_decode, "MLA decode form"))
        object.__setattr__(self, "kv_layout", _member(Layout, self.kv_layout, "KV layout"))
        object.__setattr__(self, "kv_allocator", _member(KVAllocator, self.kv_allocator, "KV allocator"))
        object.__setattr__(self, "executor", _member(ExecutorKind, self.executor, "executor"))
        object.__setattr__(self, "moe_parallel", _member(MoEParallel, self.moe_parallel, "MoE parallelism"))
        object.__setattr__(self, "capture", _member(CaptureMode, self.capture, "capture mode"))

    def engine_config(self, model: ModelConfig) -> EngineConfig:
        """The EngineConfig of these options for the resolved `model`
        (kvferry.engine.options.engine_config resolves it)."""
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_bytes=self.kv_cache_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                layout=self.kv_layout,
                kv_cache_memory_fraction=self.kv_cache_memory_fraction,
                kv_allocator=self.kv_allocator,
                kv_memory_pool=self.kv_memory_pool,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                prefill_budget_with_decodes=self.prefill_budget_with_decodes,
                default_max_tokens=self.default_max_tokens,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                executor=self.executor,
                moe_parallel=self.moe_parallel,
                cpu_cores=self.cpu_cores,
                cpu_threads=self.cpu_threads,
            ),
            kv_transfer=self.kv_transfer,
            compilation=CompilationConfig(
                capture=self.capture, enforce_eager=self.enforce_eager, cache_dir=self.cache_dir
            ),
            kv_events=self.kv_events,
            speculative=self.speculative_config,
            seed=self.seed,
        )
