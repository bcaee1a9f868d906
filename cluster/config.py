"""Typed arguments of the Serve application (`import_path: cluster.app:build_app`, `args:`)."""

from __future__ import annotations

import os
import ssl
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.auth import load_token

# Where a shipped model's name (`model: tiny-gemma3`) is looked up: the repository's model data
# directory (a path to data, not an import: `cluster` never imports `ops`).
SHIPPED_MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops", "models")


class SpeculativeArgs(BaseModel):
    """Speculative decoding (`workers.speculative.SpecConfig` checks the combination)."""

    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["standalone", "eagle", "nextn", "frozen_kv_mtp", "mtp"] = Field(
        description="how drafts are made: standalone (a small causal LM with the target's vocabulary), eagle "
        "(an EAGLE-1 or EAGLE-3 head over the target's hidden states) or frozen_kv_mtp (MTP layers that read the "
        "target's KV: a FrozenKVMTPForCausalLM head, or a Gemma 4 target's assistant, Gemma4AssistantForCausalLM); "
        "mtp is frozen_kv_mtp, nextn is eagle, or frozen_kv_mtp when the draft is a Gemma 4 assistant"
    )
    draft_model: str = Field(
        description="draft model directory, or the name of a shipped model (the in-process Engine takes a directory)"
    )
    num_steps: int = Field(
        3,
        ge=1,
        le=16,
        description="draft tokens proposed per round, all verified by one target forward: more pay off when drafts "
        "are often accepted, and cost draft time and KV lookahead when they are not",
    )
    draft_pool: Literal["swa", "full", "target"] | None = Field(
        None,
        description="where the draft's KV lives: swa (its sliding-window layers in an SWA pool; standalone only), "
        "full (every draft layer in a full pool), target (no KV of its own: frozen_kv_mtp reads the target's); "
        "null: the algorithm's default (standalone: swa when the draft has windows, else full)",
    )
    draft_load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto", description="load_format of the draft's weights (dummy: random, for benchmarks)"
    )
    draft_tp: Literal["shard", "replicate"] = Field(
        "shard",
        description="with tp_size > 1: shard the draft over the target's ranks, or replicate it on every rank "
        "(for drafts with fewer attention heads than ranks)",
    )
    token_map: str | None = Field(
        None,
        description="file of target token ids the draft proposes from (`python -m ops.token_map` makes one): its "
        "LM head keeps only their rows, for faster draft steps over a large vocabulary; lossless, the target "
        "verifies; null: the whole vocabulary",
    )
    adaptive: bool = Field(
        True,
        description="choose every decode step's draft steps in 0..num_steps for the batch from measured acceptance "
        "and measured step cost (0: a plain decode step), so that speculation never runs slower than plain decoding; "
        "false: num_steps every step",
    )


class EngineArgs(BaseModel):
    """What every rank's `workers.engine.Engine` is built with."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Hugging Face model directory, or the name of a shipped model in ops/models")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="where the ranks run; with cuda each rank of a replica takes one GPU"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of weights and activations; auto: bfloat16 on CUDA, float32 on CPU"
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="dtype of the KV cache (both pools, target and draft): auto is dtype; fp8_e4m3 stores K and V "
        "in FP8 with per-layer scales from the checkpoint (self_attn.k_scale / v_scale, else 1.0), half a bfloat16 "
        "slot's bytes, so the same memory holds twice the tokens (max_total_tokens stays in tokens); on the CPU, "
        "and on Hopper through trtllm_mha (XQA, FMHA-v2, split-KV) or torch_native; refused by Blackwell's kernel set",
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="weights of the decoder layers' projections: fp8 quantises a checkpoint in another dtype to FP8 "
        "(e4m3) as it loads, a scale per output channel (as vLLM's --quantization fp8), half a bfloat16 weight's bytes "
        "(what a decode step at small batches reads); checkpoints whose config.json has an FP8 quantization_config "
        "(a weight_scale per tensor, or weight_scale_inv per 128x128 block with weight_block_size) load as FP8 "
        "whatever this says; MXFP4 checkpoints (gpt-oss) keep their experts in 4 bits for the MoE kernels; the LM "
        "head, embeddings and drafts stay in dtype; null: as the checkpoint",
    )
    attention_backend: str | None = Field(
        None,
        description="attention kernels: trtllm_mha (TensorRT-LLM kernels through flashinfer on CUDA, strict "
        "reference kernels on CPU) or torch_native (the float32 reference); null: trtllm_mha on CUDA, "
        "torch_native on CPU",
    )
    page_size: int = Field(
        16, ge=1, description="tokens per KV page: the unit the KV pools hand out and the prefix cache shares"
    )
    max_total_tokens: int = Field(
        8192,
        ge=1,
        description="full KV pool size, in tokens, per replica: bounds the tokens of all running requests together, "
        "and the context length",
    )
    swa_full_tokens_ratio: float = Field(
        0.8,
        gt=0,
        le=1,
        description="SWA pool size relative to the full pool, for models with sliding-window layers (those keep "
        "only a window's tokens); lower it when requests are long against the window",
    )
    chunked_prefill_size: int | None = Field(
        2048,
        ge=1,
        description="most prompt tokens one prefill step runs: longer prompts are prefilled in chunks, so that "
        "running requests' decode steps are not held up long; null: no chunking",
    )
    max_running_requests: int = Field(
        64, ge=1, description="most requests running (prefilling or decoding) at once on a replica; the others wait"
    )
    context_length: int | None = Field(
        None,
        ge=2,
        description="longest sequence served, prompt and generated tokens; null: the model's max_position_embeddings; "
        "never more than max_total_tokens",
    )
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto",
        description="auto or safetensors: the model directory's safetensors (one file or a sharded index); "
        "dummy: random weights of the configured shapes, for benchmarks",
    )
    seed: int = Field(0, description="seeds dummy weights and the sampling of requests that bring no seed of their own")
    debug_kv_checks: bool = Field(
        False,
        description="check every trtllm_mha kernel call's KV contracts on CUDA too (the CPU kernels always do): "
        "slow, turns CUDA graphs off; for debugging",
    )
    tp_all_reduce: Literal["nccl", "one_shot"] = Field(
        "nccl",
        description="tensor-parallel collectives of decode size (all-reduces, with the residual add and norm "
        "after them, and the LM head's all-gather): NCCL, or one kernel over peer memory (one_shot: CUDA only; "
        "prefill-sized messages stay on NCCL)",
    )
    moe_parallel: Literal["tensor", "expert"] = Field(
        "tensor",
        description="how tensor-parallel ranks share a mixture of experts: tensor, a slice of every expert's "
        "intermediate dimension each; expert, num_experts / tp_size whole experts each, running only the chosen "
        "ones among them (num_experts must divide); either way the partial sums are all-reduced",
    )
    cuda_graphs: bool = Field(
        True,
        description="capture the decode-side forwards (decode, or speculative verify and draft steps) as CUDA graphs "
        "at start-up and replay them; CUDA with trtllm_mha only, off with debug_kv_checks; false saves start-up "
        "time and graph memory",
    )
    cuda_graph_max_batch_size: int | None = Field(
        None, ge=1, description="largest captured batch; larger ones run eagerly; null: max_running_requests"
    )
    enable_prefix_caching: bool = Field(
        True,
        description="keep computed prompt (and finished sequence) pages in a radix tree for later requests "
        "sharing their prefix",
    )
    warmup: bool | None = Field(
        None,
        description="run one short request through every forward kind at start-up, so that kernels compile "
        "(minutes on a fresh GPU) before the replica reports ready rather than in a client's first request; "
        "null: on with CUDA",
    )
    speculative: SpeculativeArgs | None = Field(
        None, description="speculative decoding, set by the speculative options; null: off"
    )

    @field_validator("model")
    @classmethod
    def _resolve_model(cls, value: str) -> str:
        if os.path.isdir(value):
            return os.path.abspath(value)
        shipped = os.path.join(SHIPPED_MODELS_DIR, value)
        if os.path.isdir(shipped):
            return shipped
        raise ValueError(f"model: {value!r} is neither a directory nor a shipped model in {SHIPPED_MODELS_DIR}")

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs = self.model_dump()
        spec = kwargs.get("speculative")
        if spec is not None:
            kwargs["speculative"] = {k: v for k, v in spec.items() if v is not None}
            kwargs["speculative"]["draft_model"] = self._resolve_model(spec["draft_model"])
        return kwargs


class GrpcArgs(BaseModel):
    """The gRPC API server (runs inside the ingress deployment)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="bind address; loopback unless told otherwise")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port")
    tls_cert_file: str | None = Field(None, description="PEM server certificate; with tls_key_file turns TLS on")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file")
    auth_token_file: str | None = Field(None, description="file holding the bearer token clients must send")
    max_message_bytes: int = Field(
        16 << 20, ge=1024, description="largest gRPC message received or sent (a prompt, a response)"
    )
    retries: int = Field(2, ge=0, description="retries on a replica failure before the first token")
    retry_backoff_s: float = Field(0.2, ge=0, description="wait before the first retry, doubled for each next one")
    ready_wait_s: float = Field(
        30.0,
        ge=0,
        description="how long a request waits for an engine replica while none runs after one has "
        "(a redeploy or a replacement) before UNAVAILABLE; 0: at once",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> GrpcArgs:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("grpc.tls_cert_file / grpc.tls_key_file: give both or neither")
        for name in ("tls_cert_file", "tls_key_file", "auth_token_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"grpc.{name}: {path!r} is not a file")
        load_token(self.auth_token_file)  # one a client can send, before any replica starts
        if self.tls_cert_file:
            try:  # grpcio would only say it failed to bind
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.tls_cert_file, self.tls_key_file
                )
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"grpc.tls_cert_file / grpc.tls_key_file: {self.tls_cert_file!r} and {self.tls_key_file!r} "
                    f"are not a PEM certificate and its key: {exc}"
                ) from exc
        return self


class TracingArgs(BaseModel):
    """OpenTelemetry export of request, router and engine-step spans."""

    model_config = ConfigDict(extra="forbid")

    exporter: Literal["none", "otlp_grpc", "otlp_http", "file"] = Field(
        "none",
        description="where spans go: none (no tracing), an OTLP collector at endpoint over gRPC or HTTP, "
        "or OTLP JSON-lines files in file_dir",
    )
    endpoint: str | None = Field(None, description="otlp_*: collector endpoint (e.g. 127.0.0.1:4317)")
    insecure: bool = Field(True, description="otlp_grpc: plaintext to the collector")
    file_dir: str | None = Field(None, description="file: directory of OTLP JSON-lines files, one per process")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of traces kept (parent-based)")
    service_name: str = Field("slidespec", description="the service.name resource attribute of every span")

    @model_validator(mode="after")
    def _destination(self) -> TracingArgs:
        if self.exporter.startswith("otlp") and not self.endpoint:
            raise ValueError("tracing.endpoint: required by the otlp exporters")
        if self.exporter == "file" and not self.file_dir:
            raise ValueError("tracing.file_dir: required by the file exporter")
        return self


class RouterArgs(BaseModel):
    """How requests are spread over replicas (cluster.routing.policies)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["round_robin", "power_of_two", "cache_aware", "consistent_hash"] = Field(
        "power_of_two",
        description="round_robin: each replica in turn; power_of_two: the less loaded (in tokens) of two random "
        "replicas; cache_aware: the replica with the longest prefix match while loads are balanced, else the "
        "least loaded; consistent_hash: a hash ring over the request's session_id keeps a session on one replica",
    )
    cache_threshold: float = Field(0.5, ge=0, le=1, description="cache_aware: prefix match that wins")
    balance_abs_threshold: float = Field(256, ge=0, description="cache_aware: token load gap that means imbalance")
    balance_rel_threshold: float = Field(1.5, ge=1, description="cache_aware: load ratio that means imbalance")
    virtual_nodes: int = Field(64, ge=1, description="consistent_hash: points per replica on the ring")

    def policy_kwargs(self) -> dict[str, Any]:
        own = {
            "cache_aware": ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold"),
            "consistent_hash": ("virtual_nodes",),
        }.get(self.policy, ())
        return {"policy": self.policy, **{name: getattr(self, name) for name in own}}


class AppArgs(EngineArgs):
    """Engine arguments plus how the replicas are laid out on the cluster."""

    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks (Ray actors) per replica")
    num_replicas: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="engine replicas, each a full copy of the model on tp_size ranks; auto: autoscaled"
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Ray Serve's autoscaling_config of the engine deployment (min_replicas, max_replicas, "
        "target_ongoing_requests, ...); given, or with num_replicas auto (then 1 to 4 replicas), replicas are "
        "autoscaled",
    )
    ingress_path: Literal["direct", "serve_handle"] = Field(
        "direct",
        description="how the ingress reaches replicas: their rank-0 actors directly (two fewer Ray hops each way), "
        "or the engine deployment's Serve handle; autoscaling always takes the handle (Serve's autoscaler "
        "counts the requests its handles carry)",
    )
    rank0_transport: Literal["socket", "ray"] = Field(
        "socket",
        description="how the ingress and the replica reach rank 0 on the hot path: over a Unix socket when on its "
        "node (rank 0's loop thread writes each step's updates; no Ray task a token), or Ray actor calls and a "
        "streaming generator; callers on another node always take Ray",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = Field(
        "STRICT_PACK",
        description="Ray placement-group strategy of a replica's bundles (its replica actor and ranks): STRICT_PACK "
        "keeps them on one node, PACK prefers one, SPREAD spreads them over nodes",
    )
    cpus_per_rank: float = Field(1.0, gt=0, description="CPUs Ray reserves for each rank actor")
    replica_cpus: float = Field(0.5, gt=0, description="CPUs Ray reserves for the replica actor (it only relays)")
    ingress_cpus: float = Field(0.5, gt=0, description="CPUs Ray reserves for the ingress (gRPC server, HTTP routes)")
    ingress_on_head: bool = Field(
        True, description="run the ingress (the gRPC port) on the head node, as Serve's HTTP proxy"
    )
    torch_threads_per_rank: int = Field(
        1, ge=1, description="torch intra-op threads of each rank; raise it to serve on CPU with cores to spare"
    )
    health_check_period_s: float = Field(
        5.0, gt=0, description="how often Ray Serve checks each replica's and the ingress's health"
    )
    health_check_timeout_s: float = Field(
        10.0, gt=0, description="a health check answered later fails, and Serve replaces the replica"
    )
    stall_timeout_s: float = Field(
        300.0, gt=0, description="a step running longer than this fails the health check (first steps compile kernels)"
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="how long a stopping replica (or ingress) lets the requests in flight finish"
    )
    max_ongoing_requests: int = Field(256, ge=1, description="requests a replica takes at once")
    stream_interval: int = Field(
        1,
        ge=1,
        description="tokens per streamed update after a request's first (as SGLang's --stream-interval): "
        "larger values send fewer messages through the stack, for more throughput under load and coarser streaming",
    )
    max_queued_requests: int = Field(
        1024, ge=1, description="requests waiting for a replica; more get RESOURCE_EXHAUSTED"
    )
    ingress_max_ongoing_requests: int = Field(
        4096, ge=1, description="HTTP requests the ingress streams at once (Serve's default of 5 would queue the rest)"
    )
    routing_stats_period_s: float = Field(
        2.0, gt=0, description="how often Serve asks each replica for the load the router weighs"
    )
    grpc: GrpcArgs = Field(default_factory=GrpcArgs)
    router: RouterArgs = Field(default_factory=RouterArgs)
    tracing: TracingArgs = Field(default_factory=TracingArgs)
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="also serve /metrics on 127.0.0.1:PORT (loopback: no token asked)"
    )
    metrics_open: bool = Field(False, description="serve the HTTP route's /metrics without the bearer token")
    max_request_bytes: int = Field(16 << 20, ge=1024, description="HTTP request bodies over this get 413")
    tool_call_parser: Literal["detect", "none", "hermes", "llama3_json"] = Field(
        "detect",
        description="the format of the model's own tool calls, parsed out of its text for the chat route's "
        "tool_choice auto: hermes (a JSON name and arguments between tool_call tags: Hermes, Qwen), llama3_json "
        "(the output is JSON objects of a name and parameters: Llama 3.1 and 3.2), detect (the format the model's "
        "chat template shows, if any), none (tool_choice auto is refused)",
    )

    @classmethod
    def from_flat(cls, args: dict[str, Any]) -> AppArgs:
        """Arguments as `serve run IMPORT_PATH key=value ...` gives them: nested settings as
        dotted keys (`speculative.algorithm=eagle`, `grpc.port=50052`) become nested dicts;
        values stay strings for pydantic to convert."""
        nested: dict[str, Any] = {}
        for key, value in args.items():
            if not isinstance(key, str):  # a YAML mapping may have a number for a key
                raise ValueError(f"{key!r}: a setting's name must be text, got {type(key).__name__}")
            *parents, leaf = key.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ValueError(f"{key}: {'.'.join(parents)} is not a group of settings")
            node[leaf] = value
        return cls(**nested)

    def total_cpus(self) -> float:
        """CPUs the application asks Ray for: every replica's bundles and the ingress."""
        per_replica = self.replica_cpus + self.tp_size * self.cpus_per_rank
        replicas = self.num_replicas if isinstance(self.num_replicas, int) else 1
        return replicas * per_replica + self.ingress_cpus

    @property
    def direct_path(self) -> bool:
        autoscaled = self.autoscaling_config is not None or self.num_replicas == "auto"
        return self.ingress_path == "direct" and not autoscaled

    def engine_args(self) -> EngineArgs:
        return EngineArgs(**{name: getattr(self, name) for name in EngineArgs.model_fields})

    def rank_bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus_per_rank}
        if self.device == "cuda":
            bundle["GPU"] = 1
        return [dict(bundle) for _ in range(self.tp_size)]


@dataclass(frozen=True)
class Setting:
    """One application setting as users name it: `grpc.port` in dotted form (`serve run` keys,
    `slidespec serve --grpc-port`), with its type, default and meaning read off the model."""

    name: str
    type: str
    default: Any  # REQUIRED when the setting has none
    description: str
    choices: tuple[Any, ...] = ()
    kind: type = str  # the Python type a command-line value becomes (bool, int, float, dict, str)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


REQUIRED = object()


def settings(model: type[BaseModel] | None = None, prefix: str = "") -> list[Setting]:
    """Every leaf setting of `model` (AppArgs by default) in declaration order; nested groups
    (`grpc`, `router`, `tracing`, `speculative`) are flattened to dotted names."""
    model = model or AppArgs
    out: list[Setting] = []
    for name, field in model.model_fields.items():
        group = _group(field.annotation)
        if group is not None:
            out.extend(settings(group, f"{prefix}{name}."))
            continue
        default = REQUIRED if field.is_required() else field.get_default(call_default_factory=True)
        out.append(
            Setting(
                name=f"{prefix}{name}",
                type=_type_name(field.annotation),
                default=default,
                description=field.description or "",
                choices=_choices(field.annotation),
                kind=_kind(field.annotation),
            )
        )
    return out


def _members(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a union (`X | None`, `Annotated[int, ...] | Literal[...]`), else itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(typing.get_args(annotation))
    return (annotation,)


def _group(annotation: Any) -> type[BaseModel] | None:
    for member in _members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _strip(annotation: Any) -> Any:
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation


def _choices(annotation: Any) -> tuple[Any, ...]:
    return tuple(
        value
        for member in map(_strip, _members(annotation))
        if typing.get_origin(member) is Literal
        for value in typing.get_args(member)
    )


def _kind(annotation: Any) -> type:
    members = [_strip(m) for m in _members(annotation) if m is not type(None)]
    for kind in (bool, dict, float, int):
        if any(m is kind or typing.get_origin(m) is kind for m in members):
            return kind if not (kind is int and _choices(annotation)) else str  # int | "auto": text
    return str


def _type_name(annotation: Any) -> str:
    names = []
    for member in map(_strip, _members(annotation)):
        if member is type(None):
            names.append("null")
        elif typing.get_origin(member) is Literal:
            names.append(" | ".join(repr(v) for v in typing.get_args(member)))
        elif typing.get_origin(member) is dict:
            names.append("mapping")
        else:
            names.append(getattr(member, "__name__", str(member)))
    return " | ".join(names)
