"""Typed, defaulted, validated view of a PDDeployment spec.

``parse_spec(raw)`` turns the ``spec`` dict of a PDDeployment into a frozen :class:`PDSpec`
or raises :class:`SpecError` listing every problem found, each naming the field, the value,
and what would be accepted. The CRD schema catches type/enum/range mistakes at admission;
this module re-checks them (manifests rendered offline never met the API server) and adds
the cross-field rules a schema cannot express.

The frozen dataclasses below are the one source of truth for every scalar field of the spec:
a field declared with :func:`knob` carries its default (the dataclass default), its JSON name,
its CRD type, its range or enum, and the ``PDRT_*`` variable the operator renders it to.
``parse_spec`` reads defaults, ranges and enums from there (no literal repeats them), and
:func:`spec_knobs` lists them with their JSON paths so that tests hold the CRD schema
(``crds/pddeployment.yaml``) and the runtime's env parser (``pdruntime/env.py``) to the same
values (``tests/operator/test_single_source.py``).

Why dataclasses with field metadata, not pydantic: the spec is config, and config in pdstack is
typed and frozen dataclasses (STYLE.md; pydantic stays at HTTP edges). Every consumer (render,
revisions, drift, the CLI) already reads these attributes; ``dataclasses.asdict`` of them feeds
the revision hash, which must not move; and the parser's job beyond types is to collect every
problem, each worded as "what was wrong; accepted: ..." (tests pin those lines), plus cross-field
rules. Pydantic would add a second object model and a second error format for the same facts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from pdruntime.util.backoff import capped_backoff

GROUP = "pdstack.io"
VERSION = "v1alpha1"
PLURAL = "pddeployments"
KIND = "PDDeployment"

ENGINES = ("pdrt", "sglang", "vllm")
AGENT_ENGINES = ("sglang", "vllm")  # engines whose worker pods carry the pdstack agent sidecar (pdrt agent)
# pdstack: pdstack's router (pdrt serve --role router) for every engine; sglang: sglang-router (engine sglang);
# vllm: accepted by the schema only to say why it is not rendered (vLLM ships no PD router command; docs/crd.md)
ROUTER_KINDS = ("pdstack", "sglang", "vllm")
CO_RESTART_POLICIES = ("Pair", "Never")
DRIFT_POLICIES = ("Report", "Revert")
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")  # mirrors pdruntime.env.ATTENTION_BACKENDS
ROUTING_POLICIES = ("least-load", "round-robin", "prefix")  # mirrors pdruntime.server.router.policy
DTYPES = ("auto", "bf16", "fp16", "fp32")  # mirrors pdruntime.engine.device.DTYPE_CHOICES
WEIGHTS = ("auto", "fp32", "int4", "int8")  # mirrors pdruntime.env.WEIGHT_FORMATS (pdrt --weights)
QUANTIZED_WEIGHTS = ("int4", "int8")  # CPU pods only: fp32 activations on pdstack's CPU kernels
WEIGHTS_AUTO = ("int4 where pdstack's CPU kernels run with AVX-512 VNNI, else the dtype's own (fp32 on CPU pods, "
                "bf16 on GPU pods)")
GPU_RESOURCE = "nvidia.com/gpu"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DEFAULT_STARTUP_SECONDS = 1800  # a 70B+ checkpoint from network storage can take tens of minutes
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")

HTTP_PORT = 8000  # every pdrt/sglang/vllm server: HTTP API, /health, /metrics
BOOTSTRAP_PORT = 8998  # prefill: KV-transfer bootstrap (pdrt, sglang)
AGENT_PORT = 8090  # the pdstack agent sidecar (runtime/pdruntime/agent AGENT_PORT): /config, /metrics, /debug/requests
# the UID both containers of an sglang/vllm worker pod run as (the pdstack images' fixed non-root user,
# images/runtime/Dockerfile): the agent reads the engine's /proc/PID/environ, which needs the same UID
WORKER_UID = 10001

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_GROUP_REPLICAS = 16  # prefill (decode) pods per group; "-<group>-decode-15-<suffix>" fits a DNS label
MAX_NAME_LEN = 40  # leaves room for "-<pair>-prefill-<suffix>" within 63 chars


# ---------------------------------------------------------------- the model's vocabulary
@dataclass(frozen=True)
class Knob:
    """What the spec says about one scalar field besides its default (the dataclass field's own default)."""

    json: str  # key in the enclosing section's JSON object; dotted when nested there ("resources.gpus")
    kind: str  # integer | number | string | boolean: the CRD schema's type
    lo: float | None = None  # inclusive range (integer, number); None = unbounded
    hi: float | None = None
    choices: tuple[str, ...] = ()  # the enum (string); () = any string
    env: str | None = None  # the PDRT_* variable render.worker_env sets from this field


@dataclass(frozen=True)
class Section:
    """A nested object of the spec: its JSON key ("" = its fields sit in the parent's object, as a role's pod
    fields do), its dataclass, range overrides ``{attr: (lo, hi)}`` that hold at this place only, and the
    fields of ``cls`` that are no field at this place (the router has no tensorParallelSize)."""

    json: str
    cls: type
    bounds: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    absent: tuple[str, ...] = ()


_KINDS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def knob(json: str, default: Any, *, kind: str | None = None, lo: float | None = None, hi: float | None = None,
         choices: tuple[str, ...] = (), env: str | None = None) -> Any:
    """A modelled scalar field; ``kind`` is implied by the default's type unless the default is None."""
    kind = kind or _KINDS[type(default)]
    if kind == "number" and lo is not None and hi is not None:  # seconds print as floats: "[0.0, 3600.0]"
        lo, hi = float(lo), float(hi)
    return field(default=default, metadata={"knob": Knob(json, kind, lo, hi, tuple(choices), env)})


def section(json: str, cls: type, *, optional: bool = False, bounds: Mapping[str, tuple[int, int]] | None = None,
            absent: tuple[str, ...] = ()) -> Any:
    """A nested object; its default is ``cls()``, or None when ``optional`` (absent = feature off)."""
    return field(default=None if optional else cls(),
                 metadata={"section": Section(json, cls, dict(bounds or {}), tuple(absent))})


def default_of(cls: type, attr: str) -> Any:
    return cls.__dataclass_fields__[attr].default


class SpecError(ValueError):
    """The spec cannot be reconciled. ``problems`` holds one actionable line per issue."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class ModelStorage:
    """Where the weights live: exactly one of a PVC, a hostPath or an image volume, mounted read-only at
    ``mount_path`` (writable while ``download`` fills it); or an emptyDir that ``download`` fills."""

    kind: str  # pvc | hostPath | image | emptyDir
    source: Mapping[str, Any]  # the core/v1 volume source of that kind
    mount_path: str = knob("mountPath", "/models")
    download_url: str | None = None  # an init container fetches it into the volume (clusters with network)
    download_size: str | None = None  # emptyDir sizeLimit for a download


@dataclass(frozen=True)
class ModelSpec:
    # path inside the image / mounted volume; None = runtime default model
    source: str | None = knob("source", None, kind="string", env="PDRT_MODEL")
    served_name: str | None = None
    # weights/activations/KV: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32
    dtype: str = knob("dtype", "auto", choices=DTYPES)
    # pdrt's weight format: fp32 (the dtype's, exact) | int4 | int8 (CPU pods) | auto (int4 on CPU pods, else fp32)
    weights: str = knob("weights", "fp32", choices=WEIGHTS)
    sha256: str | None = None  # expected weights hash: recorded in the revision; the download verifies it
    storage: ModelStorage | None = section("storage", ModelStorage, optional=True)


@dataclass(frozen=True)
class PodTemplate:
    """Per-role pod fields; each role's own value wins over ``spec.podTemplate`` (the shared default).

    Mappings/lists of Kubernetes types (tolerations, affinity, containers, ...) are kept as the user's
    objects: the CRD schema validates them at admission, Kubernetes at pod creation.
    """

    image: str | None = None
    image_pull_policy: str | None = knob("imagePullPolicy", None, kind="string", choices=PULL_POLICIES)
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    # None = the secure default (False)
    automount_service_account_token: bool | None = knob("automountServiceAccountToken", None, kind="boolean")
    env_from: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str | None = None
    containers: tuple[Mapping[str, Any], ...] = ()  # sidecars, appended after the main container
    shared_memory_size: str | None = None  # a memory-backed emptyDir at /dev/shm of this size limit
    termination_grace_period_s: int | None = knob("terminationGracePeriodSeconds", None, kind="integer", lo=0,
                                                  hi=86400)
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    security_context: Mapping[str, Any] = field(default_factory=dict)  # merged over the container default
    pod_security_context: Mapping[str, Any] = field(default_factory=dict)  # merged over the pod default

    def over(self, base: "PodTemplate") -> "PodTemplate":
        """This template's set fields over ``base``'s (maps merge key by key, this side winning)."""
        out = {}
        for f in self.__dataclass_fields__:
            mine, theirs = getattr(self, f), getattr(base, f)
            if isinstance(mine, Mapping) and f in ("node_selector", "annotations", "labels", "security_context",
                                                   "pod_security_context"):
                out[f] = {**theirs, **mine}
            else:
                out[f] = mine if mine not in (None, (), {}) else theirs
        return PodTemplate(**out)


@dataclass(frozen=True)
class Probes:
    """Worker probes. Startup covers the model load; liveness only runs after startup succeeded."""

    # model-load budget before the kubelet gives up and restarts
    startup_s: int = knob("startupSeconds", DEFAULT_STARTUP_SECONDS, lo=10, hi=86400)
    # None = the engine's default (pdrt 2 s, sglang 10 s: /health generates)
    readiness_timeout_s: int | None = knob("readinessTimeoutSeconds", None, kind="integer", lo=1, hi=600)
    liveness_period_s: int = knob("livenessPeriodSeconds", 10, lo=1, hi=3600)
    # a hung engine is restarted after period * failures seconds
    liveness_failures: int = knob("livenessFailureThreshold", 6, lo=1, hi=1000)
    # preStop: stop taking requests and let in-flight ones finish (within the grace period)
    drain_s: int = knob("preStopDrainSeconds", 10, lo=0, hi=3600)


@dataclass(frozen=True)
class RoleSpec:
    """One role's pods. Ranges here are a worker role's (prefill, decode); ``PDSpec.router`` overrides them."""

    replicas: int = knob("replicas", 1, lo=1, hi=MAX_GROUP_REPLICAS)  # pods of this role per P:D group
    gpus: int = knob("resources.gpus", 0, lo=0, hi=64)  # nvidia.com/gpu per pod (requests == limits)
    requests: Mapping[str, str] = field(default_factory=dict)  # cpu / memory
    limits: Mapping[str, str] = field(default_factory=dict)
    env: tuple[tuple[str, Any], ...] = ()  # (name, value or {"valueFrom": {...}}), in declared order
    args: tuple[str, ...] = ()  # appended to the rendered command line
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    # set explicitly; None = one rank per GPU (see tp_size)
    tensor_parallel: int | None = knob("tensorParallelSize", None, kind="integer", lo=1, hi=64)
    pod: PodTemplate = section("", PodTemplate)  # the role's own pod fields; merged with spec.podTemplate at parse

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of a worker: the spec's value, else one per GPU (1 without GPUs)."""
        return self.tensor_parallel if self.tensor_parallel is not None else max(1, self.gpus)

    @property
    def device(self) -> str:
        """The runtime's --device: cuda when the pod gets GPUs, else cpu."""
        return "cuda" if self.gpus > 0 else "cpu"


GROUP_PLACEMENTS = ("Preferred", "Required", "None")


@dataclass(frozen=True)
class Placement:
    # a group's pods on one node (KV transfer stays local), groups spread
    group_placement: str = knob("groupPlacement", "Preferred", choices=GROUP_PLACEMENTS)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None


SGLANG_TRANSFER_BACKENDS = ("nixl", "mooncake", "mooncake_tcp", "fake")  # SGLang's own choices, minus NPU ones


@dataclass(frozen=True)
class SglangSpec:
    """engine: sglang only. The KV-transfer backend is always rendered explicitly: SGLang's own default is
    mooncake over RDMA, which fails on a node without an RDMA device."""

    # NIXL over UCX works on TCP; mooncake needs RDMA (ibDevice + rdmaResources)
    transfer_backend: str = knob("transferBackend", "nixl", choices=SGLANG_TRANSFER_BACKENDS)
    ib_device: str | None = None  # --disaggregation-ib-device, e.g. mlx5_0
    rdma_resources: Mapping[str, str] = field(default_factory=dict)  # e.g. {"rdma/ib": "1"}: requests == limits


VLLM_KV_CONNECTOR = "NixlConnector"  # vLLM's PD connector as llm-d deploys it (kv_role kv_both on both sides)


@dataclass(frozen=True)
class VllmSpec:
    """engine: vllm only. Flags and env from vLLM's own source (vllm/engine/arg_utils.py, vllm/envs.py); the
    connector is always NixlConnector with kv_role kv_both, as llm-d renders it."""

    # VLLM_NIXL_SIDE_CHANNEL_PORT: the NIXL handshake listener (vllm/envs.py default 5600; + the data-parallel
    # index, 0 here); the NetworkPolicy admits it between the deployment's workers
    nixl_side_channel_port: int = knob("nixlSideChannelPort", 5600, lo=1024, hi=65535)
    max_model_len: int | None = knob("maxModelLen", None, kind="integer", lo=1, hi=1 << 24)  # --max-model-len
    # --gpu-memory-utilization: share of each GPU vLLM may take (its default 0.9)
    gpu_memory_utilization: float | None = knob("gpuMemoryUtilization", None, kind="number", lo=0.01, hi=1)
    enforce_eager: bool = knob("enforceEager", False)  # --enforce-eager: no CUDA graphs


@dataclass(frozen=True)
class KernelKnobs:
    # 0 = derive from the device (SMs x waves)
    decode_target_ctas: int = knob("decodeTargetCTAs", 0, lo=0, hi=1 << 16, env="PDRT_DECODE_TARGET_CTAS")
    max_kv_splits: int = knob("maxKVSplits", 32, lo=1, hi=1024, env="PDRT_MAX_KV_SPLITS")
    attention_backend: str = knob("attentionBackend", "auto", choices=ATTENTION_BACKENDS, env="PDRT_ATTENTION_BACKEND")


@dataclass(frozen=True)
class WatchdogSpec:
    """PD watchdogs, seconds; each must exceed ``tick_s`` (checked in parse_spec)."""

    bootstrap_timeout_s: float = knob("bootstrapTimeoutSeconds", 30.0, lo=0.01, hi=86400,
                                      env="PDRT_BOOTSTRAP_TIMEOUT_S")
    # KV-transfer phase only, never the decode phase
    transfer_timeout_s: float = knob("transferTimeoutSeconds", 60.0, lo=0.01, hi=86400, env="PDRT_TRANSFER_TIMEOUT_S")
    decode_transfer_timeout_s: float = knob("decodeTransferTimeoutSeconds", 60.0, lo=0.01, hi=86400,
                                            env="PDRT_DECODE_TRANSFER_TIMEOUT_S")
    # decode, before the KV is ready: fails only a prefill that stops making progress, however long it takes
    prefill_stall_s: float = knob("prefillStallSeconds", 60.0, lo=0.01, hi=86400, env="PDRT_PREFILL_STALL_S")
    tick_s: float = knob("tickSeconds", 0.5, lo=0.001, hi=60, env="PDRT_WATCHDOG_TICK_S")


@dataclass(frozen=True)
class CoRestartSpec:
    policy: str = knob("policy", "Pair", choices=CO_RESTART_POLICIES)
    backoff_initial_s: float = knob("backoff.initialSeconds", 1.0, lo=0, hi=3600)
    backoff_max_s: float = knob("backoff.maxSeconds", 300.0, lo=0, hi=86400)

    def backoff(self, streak: int) -> float:
        """Seconds to wait before recreating a pair after its ``streak``-th consecutive co-restart."""
        return capped_backoff(streak, self.backoff_initial_s, self.backoff_max_s)


@dataclass(frozen=True)
class CanarySpec:
    """spec.rollout.canary: a new revision goes to one pair first, which the router takes out of normal traffic;
    the multi-round agent probe (``pdrt probe agents``) runs against it, and only a clean probe promotes it."""

    agents: int = knob("agents", 8, lo=1, hi=64)  # concurrent agents, each on its own keep-alive connection
    # rounds per agent; each round's context grows by the previous answer and a tool result
    rounds: int = knob("rounds", 10, lo=1, hi=100)
    # a round not finished within this is a hang
    round_timeout_s: float = knob("roundTimeoutSeconds", 60.0, lo=1, hi=3600)
    max_tokens: int = knob("maxTokens", 16, lo=1, hi=4096)  # completion tokens per round


@dataclass(frozen=True)
class RolloutSpec:
    """spec.rollout beyond pacing: soak, canary and auto-rollback. None of it is part of the revision."""

    soak_s: int = knob("soakSeconds", 300, lo=0, hi=86400)  # serving this long with no stall makes it lastKnownGood
    # None: no canary, every pair rolls as maxUnavailablePairs allows
    canary: CanarySpec | None = section("canary", CanarySpec, optional=True)
    # a stall within rollback_window_s of a revision change rolls back to lastKnownGood
    auto_rollback: bool = knob("autoRollback", False)
    rollback_window_s: int = knob("rollbackWindowSeconds", 900, lo=0, hi=86400)


@dataclass(frozen=True)
class StallSpec:
    """spec.stall: when a pair counts as Stalled (read from its /debug/requests and /metrics)."""

    # a live request with no progress for this long (or that old before decode) is stuck
    seconds: float = knob("seconds", 60.0, lo=1, hi=86400)


@dataclass(frozen=True)
class PrefixCacheSpec:
    """spec.prefixCache: the workers' prefix cache (KV pages kept by their token prefix and reused by later
    requests; decode keeps what it generated, and the KV wire sends only what decode lacks). On by default, as in
    the runtime; only a value that differs from the default is rendered, so existing revisions keep their hash."""

    enabled: bool = knob("enabled", True)  # pdrt: --no-prefix-cache when false; sglang: --disable-radix-cache
    max_pages: int | None = knob("maxPages", None, kind="integer", lo=1, hi=1 << 30)  # pdrt: --prefix-cache-max-pages


@dataclass(frozen=True)
class RoutingSpec:
    """spec.router.routing: how pdrt's router picks a pair for normal traffic (its --routing-policy and
    thresholds; the defaults are the router's own, and only values that differ are rendered). Not part of a
    revision: changing it restarts the router, never a pair."""

    policy: str = knob("policy", "least-load", choices=ROUTING_POLICIES)
    # prefix: the load bound (then least-load decides): busiest - idlest > abs and busiest > rel x idlest
    balance_abs_threshold: int = knob("balanceAbsThreshold", 8, lo=0, hi=1 << 16)
    balance_rel_threshold: float = knob("balanceRelThreshold", 1.5, lo=1, hi=1000)
    # prefix: share of the prompt a pair must hold to win on its prefix
    cache_threshold: float = knob("cacheThreshold", 0.3, lo=0, hi=1)
    # prefix: prompt characters the router remembers per pair (LRU)
    prefix_tree_max_chars: int = knob("prefixTreeMaxChars", 1 << 20, lo=32, hi=1 << 30)


@dataclass(frozen=True)
class PDSpec:
    image: str
    engine: str = knob("engine", "pdrt", choices=ENGINES)
    model: ModelSpec = section("model", ModelSpec)
    pairs: int = knob("pairs", 1, lo=0, hi=256)
    prefill: RoleSpec = section("prefill", RoleSpec)
    decode: RoleSpec = section("decode", RoleSpec)
    router: RoleSpec = section("router", RoleSpec, bounds={"replicas": (0, 64), "gpus": (0, 0)},
                               absent=("tensor_parallel",))  # CPU-only, outside the P:D groups, no TP ranks
    placement: Placement = section("placement", Placement)
    kernel: KernelKnobs = section("kernel", KernelKnobs)
    watchdog: WatchdogSpec = section("watchdog", WatchdogSpec)
    co_restart: CoRestartSpec = section("coRestart", CoRestartSpec)
    drift_policy: str = knob("drift.policy", "Report", choices=DRIFT_POLICIES)
    max_unavailable_pairs: int = knob("rollout.maxUnavailablePairs", 1, lo=1, hi=256)
    # in-flight requests of a draining pair may finish this long before deletion
    drain_seconds: float = knob("rollout.drainSeconds", 30.0, lo=0, hi=3600)
    revision_history_limit: int = knob("revisionHistoryLimit", 10, lo=1, hi=1000)
    probes: Probes = section("probes", Probes)
    sglang: SglangSpec = section("sglang", SglangSpec)
    vllm: VllmSpec = section("vllm", VllmSpec)
    # the pdstack runtime image for the agent sidecar (engines sglang, vllm) and pdstack's router with them
    runtime_image: str | None = knob("runtimeImage", None, kind="string")
    router_kind: str = knob("router.kind", "pdstack", choices=ROUTER_KINDS)  # spec.router.kind
    # pdstack's router's processes per pod (--router-processes; docs/router.md): each on a core of its own
    router_processes: int = knob("router.processes", 1, lo=1, hi=64)
    rollout: RolloutSpec = section("rollout", RolloutSpec)
    stall: StallSpec = section("stall", StallSpec)
    prefix_cache: PrefixCacheSpec = section("prefixCache", PrefixCacheSpec)
    routing: RoutingSpec = section("router.routing", RoutingSpec)  # spec.router.routing (the router's policy)

    def router_image(self) -> str:
        """spec.router.image, else the image that has the router: spec.image for engine pdrt and for the engine's
        own router, spec.runtimeImage for pdstack's router in front of SGLang or vLLM. Never an image the user did
        not name: a hard-coded registry tag never pulls on kind (only loaded images run) or air-gapped clusters.
        The router is CPU-only, so with a CUDA spec.image set spec.router.image to the CPU runtime image to spare
        the router its gigabytes."""
        if self.router.pod.image:
            return self.router.pod.image
        if self.pdstack_router and self.engine != "pdrt":
            return self.runtime_image or self.image
        return self.image

    @property
    def pdstack_router(self) -> bool:
        """pdstack's router fronts the groups (pushed topology: drain before delete, canary, /debug/requests)."""
        return self.router_kind == "pdstack"

    @property
    def has_agent(self) -> bool:
        """Worker pods carry the pdstack agent sidecar (the engine is not pdrt, which serves /config itself)."""
        return self.engine in AGENT_ENGINES

    @property
    def gpus_per_pair(self) -> int:
        return self.prefill.gpus * self.prefill.replicas + self.decode.gpus * self.decode.replicas


@dataclass(frozen=True)
class KnobAt:
    """A modelled field at its place in the spec."""

    path: str  # JSON path under ``spec``, e.g. "rollout.canary.roundTimeoutSeconds", "router.resources.gpus"
    attrs: tuple[str, ...]  # attribute path from PDSpec, e.g. ("rollout", "canary", "round_timeout_s")
    cls: type  # the dataclass that declares it
    attr: str
    knob: Knob  # with this place's range (the router's bounds applied)
    default: Any


def spec_knobs(place: Section = Section("", PDSpec), prefix: str = "", attrs: tuple[str, ...] = ()
               ) -> tuple[KnobAt, ...]:
    """Every modelled scalar field of the spec, depth first in declaration order."""
    out: list[KnobAt] = []
    for f in fields(place.cls):
        if f.name in place.absent:
            continue
        if "knob" in f.metadata:
            k = f.metadata["knob"]
            if f.name in place.bounds:
                k = replace(k, lo=place.bounds[f.name][0], hi=place.bounds[f.name][1])
            out.append(KnobAt(".".join(p for p in (prefix, k.json) if p), attrs + (f.name,), place.cls, f.name, k,
                              f.default))
        elif "section" in f.metadata:
            s = f.metadata["section"]
            out.extend(spec_knobs(s, ".".join(p for p in (prefix, s.json) if p), attrs + (f.name,)))
    return tuple(out)


def section_of(cls: type, attr: str) -> Section:
    return cls.__dataclass_fields__[attr].metadata["section"]


# Env vars the operator derives from typed spec fields; setting them by hand is rejected
# so one knob has one source (and one place in the revision diff).
OPERATOR_OWNED_ENV = {
    **{k.knob.env: f"spec.{k.path}" for k in spec_knobs() if k.knob.env},
    "PDRT_KV_AUTH_TOKEN_FILE": "the operator (it mounts the KV-transfer Secret)",
    "PDRT_KV_AUTH_TOKEN": "the operator (it mounts the KV-transfer Secret)",
    # engine vllm (render.worker_env): the NIXL side channel
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "the operator (the pod's IP)",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "spec.vllm.nixlSideChannelPort",
}


# ---------------------------------------------------------------- parsing helpers
class _Reader:
    """Collects problems instead of stopping at the first one."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, path: str, value: Any, accepted: str) -> None:
        self.problems.append(f"{path}={value!r} is invalid; accepted: {accepted}")

    def obj(self, raw: Any, path: str) -> Mapping[str, Any]:
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            self.fail(path, raw, "an object")
            return {}
        return raw

    def int_(self, raw: Mapping[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(f"{path}.{key}", value, f"an integer in [{lo}, {hi}]")
            return default
        return value

    def num(self, raw: Mapping[str, Any], key: str, path: str, default: float, lo: float, hi: float) -> float:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            what = "a number of seconds" if key.lower().endswith("seconds") else "a number"
            self.fail(f"{path}.{key}", value, f"{what} in [{lo}, {hi}]")
            return default
        return float(value)

    def choice(self, raw: Mapping[str, Any], key: str, path: str, default: str, choices: tuple[str, ...]) -> str:
        value = raw.get(key, default)
        if value not in choices:
            self.fail(f"{path}.{key}", value, " | ".join(choices))
            return default
        return value

    def bool_(self, raw: Mapping[str, Any], key: str, path: str, default: bool | None) -> bool | None:
        value = raw.get(key, default)
        if not isinstance(value, bool):
            self.fail(f"{path}.{key}", value, "true | false")
            return default
        return value

    def take(self, raw: Mapping[str, Any], path: str, cls: type, attr: str,
             bounds: Mapping[str, tuple[int, int]] | None = None) -> Any:
        """The modelled field ``cls.attr`` read from ``raw`` (the JSON object at ``path``): its default when
        absent, else checked against its kind and its range (``bounds`` override) or choices."""
        k: Knob = cls.__dataclass_fields__[attr].metadata["knob"]
        default = default_of(cls, attr)
        key = k.json.rsplit(".", 1)[-1]
        if default is None and raw.get(key) is None:
            return None
        lo, hi = (bounds or {}).get(attr, (k.lo, k.hi))
        if k.kind == "integer":
            return self.int_(raw, key, path, default, lo, hi)
        if k.kind == "number":
            return self.num(raw, key, path, default, lo, hi)
        if k.kind == "boolean":
            return self.bool_(raw, key, path, default)
        if k.choices:
            return self.choice(raw, key, path, default, k.choices)
        value = self.str_(raw, key, path)
        return default if value is None else value

    def str_(self, raw: Mapping[str, Any], key: str, path: str, *, required: bool = False) -> str | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.problems.append(f"{path}.{key} is required; accepted: a non-empty string")
            return None
        if not isinstance(value, str) or (required and not value.strip()):
            self.fail(f"{path}.{key}", value, "a non-empty string")
            return None
        return value

    def str_map(self, raw: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
        value = self.obj(raw.get(key), f"{path}.{key}")
        out: dict[str, str] = {}
        for k, v in value.items():
            if not isinstance(v, (str, int, float)) or isinstance(v, bool):
                self.fail(f"{path}.{key}.{k}", v, "a string or number")
                continue
            out[str(k)] = str(v)
        return out

    def list_of_obj(self, raw: Mapping[str, Any], key: str, path: str) -> tuple[Mapping[str, Any], ...]:
        value = raw.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            self.fail(f"{path}.{key}", value, "a list of objects")
            return ()
        return tuple(value)


def _role(r: _Reader, raw: Any, path: str, place: Section) -> RoleSpec:
    d = r.obj(raw, path)
    for attr in place.absent:
        key = RoleSpec.__dataclass_fields__[attr].metadata["knob"].json
        if d.get(key) is not None:
            r.problems.append(f"{path}.{key} is not a field of {path}; accepted: {key} on spec.prefill and spec.decode")
    replicas = r.take(d, path, RoleSpec, "replicas", place.bounds)  # pods of this role per P:D group
    res = r.obj(d.get("resources"), f"{path}.resources")
    gpus = r.take(res, f"{path}.resources", RoleSpec, "gpus", place.bounds)
    env: list[tuple[str, str]] = []
    seen: set[str] = set()
    raw_env = d.get("env") or []
    if not isinstance(raw_env, list):
        r.fail(f"{path}.env", raw_env, "a list of {name, value}")
        raw_env = []
    for i, item in enumerate(raw_env):
        epath = f"{path}.env[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            r.fail(epath, item, "{name: ENV_NAME, value: string}")
            continue
        name = item["name"]
        if not _ENV_NAME.match(name):
            r.fail(f"{epath}.name", name, "a C identifier such as MY_VAR")
            continue
        if name in OPERATOR_OWNED_ENV:
            r.problems.append(f"{epath}.name={name!r} is set by the operator; set {OPERATOR_OWNED_ENV[name]} instead")
            continue
        if name in seen:
            r.problems.append(f"{epath}.name={name!r} is declared twice; accepted: each name once")
            continue
        seen.add(name)
        if item.get("valueFrom") is not None:
            ref = _value_from(r, item["valueFrom"], f"{epath}.valueFrom")
            if ref is None:
                continue
            if "value" in item:
                r.problems.append(f"{epath} sets both value and valueFrom; accepted: one of them")
                continue
            env.append((name, {"valueFrom": ref}))
            continue
        value = item.get("value", "")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            r.fail(f"{epath}.value", value, "a string")
            continue
        env.append((name, str(value)))
    tp = None if "tensor_parallel" in place.absent else r.take(d, path, RoleSpec, "tensor_parallel")
    if tp is not None and gpus and tp > gpus:
        r.problems.append(f"{path}.tensorParallelSize={tp} exceeds {path}.resources.gpus={gpus}; accepted: "
                          f"at most one rank per GPU (1..{gpus})")
    args = d.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        r.fail(f"{path}.args", args, "a list of strings")
        args = []
    return RoleSpec(
        pod=_pod_template(r, d, path),
        replicas=replicas,
        gpus=gpus,
        requests=r.str_map(res, "requests", f"{path}.resources"),
        limits=r.str_map(res, "limits", f"{path}.resources"),
        env=tuple(env),
        args=tuple(args),
        volumes=r.list_of_obj(d, "volumes", path),
        volume_mounts=r.list_of_obj(d, "volumeMounts", path),
        tensor_parallel=tp,
    )


MODEL_STORAGE_KINDS = {"pvc": "persistentVolumeClaim", "hostPath": "hostPath", "image": "image"}


def _model_storage(r: _Reader, raw: Any) -> ModelStorage | None:
    if raw is None:
        return None
    d = r.obj(raw, "spec.model.storage")
    kinds = [k for k in MODEL_STORAGE_KINDS if k in d]
    dl = r.obj(d.get("download"), "spec.model.storage.download")
    url = r.str_(dl, "url", "spec.model.storage.download", required=bool(dl)) if dl else None
    if url is not None and not url.startswith(("https://", "http://")):
        r.fail("spec.model.storage.download.url", url, "an http(s) URL")
    mount = r.take(d, "spec.model.storage", ModelStorage, "mount_path") or default_of(ModelStorage, "mount_path")
    if not mount.startswith("/"):
        r.fail("spec.model.storage.mountPath", mount, "an absolute path")
    if len(kinds) > 1 or (not kinds and not dl):
        r.problems.append(f"spec.model.storage sets {kinds or 'no source'}; accepted: exactly one of pvc, hostPath, "
                          "image (or only download, into an emptyDir)")
        return None
    if not kinds:
        return ModelStorage("emptyDir", {}, mount, url, r.str_(dl, "sizeLimit", "spec.model.storage.download"))
    kind = kinds[0]
    src = dict(r.obj(d[kind], f"spec.model.storage.{kind}"))
    need = {"pvc": "claimName", "hostPath": "path", "image": "reference"}[kind]
    if not isinstance(src.get(need), str) or not src[need]:
        r.fail(f"spec.model.storage.{kind}.{need}", src.get(need), "a non-empty string")
    if dl and kind != "pvc":
        r.problems.append(f"spec.model.storage.download with {kind}: accepted: download into a pvc (or an emptyDir: "
                          "no pvc/hostPath/image)")
    if dl and src.get("readOnly"):
        r.problems.append("spec.model.storage.pvc.readOnly=true with download: the init container must write it; "
                          "accepted: readOnly false (workers still mount it read-only)")
    return ModelStorage(kind, src, mount, url, None)


_VALUE_FROM = {"secretKeyRef": ("name", "key"), "configMapKeyRef": ("name", "key"), "fieldRef": ("fieldPath",),
               "resourceFieldRef": ("resource",)}


def _value_from(r: _Reader, raw: Any, path: str) -> dict[str, Any] | None:
    """An EnvVarSource: exactly one of secretKeyRef / configMapKeyRef / fieldRef / resourceFieldRef."""
    if not isinstance(raw, Mapping) or len(raw) != 1 or next(iter(raw)) not in _VALUE_FROM:
        r.fail(path, raw, "exactly one of " + " | ".join(_VALUE_FROM))
        return None
    kind, ref = next(iter(raw.items()))
    if not isinstance(ref, Mapping) or any(not isinstance(ref.get(k), str) or not ref.get(k)
                                           for k in _VALUE_FROM[kind]):
        r.fail(f"{path}.{kind}", ref, "an object with " + ", ".join(_VALUE_FROM[kind]))
        return None
    return {kind: dict(ref)}


def _pod_template(r: _Reader, d: Mapping[str, Any], path: str) -> PodTemplate:
    pull = r.take(d, path, PodTemplate, "image_pull_policy")
    secrets = []
    for i, s in enumerate(d.get("imagePullSecrets") or []):
        if isinstance(s, Mapping) and isinstance(s.get("name"), str) and s["name"]:
            secrets.append(s["name"])
        else:
            r.fail(f"{path}.imagePullSecrets[{i}]", s, "{name: SECRET_NAME}")
    shm = d.get("sharedMemorySize")
    if shm is not None and (not isinstance(shm, (str, int)) or isinstance(shm, bool) or not _QUANTITY.match(str(shm))):
        r.fail(f"{path}.sharedMemorySize", shm, "a quantity such as 16Gi")
        shm = None
    automount = r.take(d, path, PodTemplate, "automount_service_account_token")
    grace = r.take(d, path, PodTemplate, "termination_grace_period_s")
    sidecars = r.list_of_obj(d, "containers", path)
    for i, c in enumerate(sidecars):
        if not isinstance(c.get("name"), str) or not _DNS_LABEL.match(c.get("name", "")) \
                or c.get("name") in ("prefill", "decode", "router", "pdstack-agent"):
            r.fail(f"{path}.containers[{i}].name", c.get("name"),
                   "a DNS label other than prefill/decode/router/pdstack-agent (the operator's own containers)")
    return PodTemplate(
        image=r.str_(d, "image", path),
        image_pull_policy=pull,
        image_pull_secrets=tuple(secrets),
        service_account_name=r.str_(d, "serviceAccountName", path),
        automount_service_account_token=automount,
        env_from=r.list_of_obj(d, "envFrom", path),
        node_selector=r.str_map(d, "nodeSelector", path),
        tolerations=r.list_of_obj(d, "tolerations", path),
        affinity=r.obj(d.get("affinity"), f"{path}.affinity"),
        topology_spread_constraints=r.list_of_obj(d, "topologySpreadConstraints", path),
        priority_class_name=r.str_(d, "priorityClassName", path),
        containers=sidecars,
        shared_memory_size=None if shm is None else str(shm),
        termination_grace_period_s=grace,
        annotations=r.str_map(d, "podAnnotations", path),
        labels=r.str_map(d, "podLabels", path),
        security_context=r.obj(d.get("securityContext"), f"{path}.securityContext"),
        pod_security_context=r.obj(d.get("podSecurityContext"), f"{path}.podSecurityContext"),
    )


def _check_weights(r: _Reader, model: ModelSpec, engine: str, prefill: RoleSpec, decode: RoleSpec) -> None:
    """spec.model.weights is pdrt's ``--weights``: another engine has no such flag, and the 4-bit and 8-bit formats
    run on pdstack's CPU kernels (fp32 activations), so on CPU pods only."""
    if model.weights == default_of(ModelSpec, "weights"):
        return
    if engine != "pdrt":
        r.problems.append(f"spec.model.weights={model.weights!r} is pdstack's runtime's --weights and engine "
                          f"'{engine}' has no such flag; accepted: fp32 (the default) with engine '{engine}', whose "
                          "own quantisation flags go in spec.prefill.args and spec.decode.args")
        return
    if model.weights not in QUANTIZED_WEIGHTS:
        return
    gpu_roles = [f"spec.{role}.resources.gpus={x.gpus}" for role, x in (("prefill", prefill), ("decode", decode))
                 if x.gpus]
    if gpu_roles:
        r.problems.append(f"spec.model.weights={model.weights!r} runs on CPU pods only (pdstack's CPU kernels), but "
                          f"{' and '.join(gpu_roles)}; accepted: fp32 or auto on GPU pods (auto: {WEIGHTS_AUTO})")
    elif model.dtype not in ("auto", "fp32"):
        r.problems.append(f"spec.model.weights={model.weights!r} computes in fp32, but spec.model.dtype="
                          f"{model.dtype!r}; accepted: dtype auto or fp32 with weights {model.weights}, or weights "
                          "fp32 or auto with that dtype")


def _model(r: _Reader, d: Mapping[str, Any], engine: str) -> ModelSpec:
    m = r.obj(d.get("model"), "spec.model")
    sha = r.str_(m, "sha256", "spec.model")
    if sha is not None and not re.fullmatch(r"[0-9a-f]{64}", sha):
        r.fail("spec.model.sha256", sha, "64 lowercase hex digits")
        sha = None
    model = ModelSpec(source=r.take(m, "spec.model", ModelSpec, "source"),
                      served_name=r.str_(m, "servedName", "spec.model"),
                      dtype=r.take(m, "spec.model", ModelSpec, "dtype"),
                      weights=r.take(m, "spec.model", ModelSpec, "weights"), sha256=sha,
                      storage=_model_storage(r, m.get("storage")))
    if model.storage and model.source and not model.source.startswith(model.storage.mount_path.rstrip("/") + "/"):
        r.problems.append(f"spec.model.source={model.source!r} is outside spec.model.storage.mountPath="
                          f"{model.storage.mount_path!r}; accepted: a path under the mount, e.g. "
                          f"{model.storage.mount_path.rstrip('/')}/model.gguf")
    if engine != "pdrt" and not model.source:
        r.problems.append(f"spec.model.source is required with engine '{engine}'; accepted: a model path or HF id")
    return model


def _watchdog(r: _Reader, d: Mapping[str, Any]) -> WatchdogSpec:
    w = r.obj(d.get("watchdog"), "spec.watchdog")
    watchdog = WatchdogSpec(**{a: r.take(w, "spec.watchdog", WatchdogSpec, a)
                               for a in WatchdogSpec.__dataclass_fields__})
    for key, value in (("transferTimeoutSeconds", watchdog.transfer_timeout_s),
                       ("decodeTransferTimeoutSeconds", watchdog.decode_transfer_timeout_s),
                       ("prefillStallSeconds", watchdog.prefill_stall_s),
                       ("bootstrapTimeoutSeconds", watchdog.bootstrap_timeout_s)):
        if value <= watchdog.tick_s:
            r.problems.append(f"spec.watchdog.{key}={value} must exceed spec.watchdog.tickSeconds={watchdog.tick_s}; "
                              "a watchdog cannot fire before its first tick")
    return watchdog


def _co_restart(r: _Reader, d: Mapping[str, Any]) -> CoRestartSpec:
    c = r.obj(d.get("coRestart"), "spec.coRestart")
    b = r.obj(c.get("backoff"), "spec.coRestart.backoff")
    co = CoRestartSpec(
        policy=r.take(c, "spec.coRestart", CoRestartSpec, "policy"),
        backoff_initial_s=r.take(b, "spec.coRestart.backoff", CoRestartSpec, "backoff_initial_s"),
        backoff_max_s=r.take(b, "spec.coRestart.backoff", CoRestartSpec, "backoff_max_s"),
    )
    if co.backoff_initial_s > co.backoff_max_s:
        r.problems.append(f"spec.coRestart.backoff.initialSeconds={co.backoff_initial_s} exceeds "
                          f"maxSeconds={co.backoff_max_s}; accepted: initialSeconds <= maxSeconds")
    return co


def _rollout(r: _Reader, ro: Mapping[str, Any]) -> RolloutSpec:
    canary = None
    if ro.get("canary") is not None:
        cn = r.obj(ro.get("canary"), "spec.rollout.canary")
        canary = CanarySpec(**{a: r.take(cn, "spec.rollout.canary", CanarySpec, a)
                               for a in CanarySpec.__dataclass_fields__})
    auto = r.take(ro, "spec.rollout", RolloutSpec, "auto_rollback")
    return RolloutSpec(
        soak_s=r.take(ro, "spec.rollout", RolloutSpec, "soak_s"),
        canary=canary,
        auto_rollback=auto,
        rollback_window_s=r.take(ro, "spec.rollout", RolloutSpec, "rollback_window_s"),
    )


def _prefix_cache(r: _Reader, d: Mapping[str, Any], engine: str) -> PrefixCacheSpec:
    pc = r.obj(d.get("prefixCache"), "spec.prefixCache")
    out = PrefixCacheSpec(**{a: r.take(pc, "spec.prefixCache", PrefixCacheSpec, a)
                             for a in PrefixCacheSpec.__dataclass_fields__})
    if out.max_pages is not None and engine != "pdrt":
        r.problems.append(f"spec.prefixCache.maxPages is pdrt's --prefix-cache-max-pages; accepted with engine "
                          f"'{engine}': enabled only (the engine sizes its prefix cache from its KV pool)")
    return out


def _router(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """spec.router, or {} when it is not an object (_role has said so)."""
    router = d.get("router")
    return router if isinstance(router, Mapping) else {}


def _router_kind(r: _Reader, d: Mapping[str, Any], engine: str) -> str:
    kind = r.take(_router(d), "spec.router", PDSpec, "router_kind")
    if kind == "vllm":
        r.problems.append("spec.router.kind='vllm' is not rendered: vLLM ships no PD router command (only example "
                          "proxies; vllm-router is a separate project); accepted: kind pdstack, whose router speaks "
                          "vLLM's kv_transfer_params exchange")
    elif kind == "sglang" and engine != "sglang":
        r.problems.append(f"spec.router.kind='sglang' with engine '{engine}'; accepted: kind sglang only with engine "
                          "sglang, kind pdstack with any engine")
    return kind


def _router_processes(r: _Reader, d: Mapping[str, Any], kind: str) -> int:
    n = r.take(_router(d), "spec.router", PDSpec, "router_processes")
    if n != 1 and kind != "pdstack":
        r.problems.append(f"spec.router.processes={n} is pdstack's router's; accepted with router kind '{kind}': 1 "
                          "(sglang-router runs threads of its own)")
    return n


def _routing(r: _Reader, d: Mapping[str, Any], kind: str) -> RoutingSpec:
    ro = r.obj(_router(d).get("routing"), "spec.router.routing")
    routing = RoutingSpec(**{a: r.take(ro, "spec.router.routing", RoutingSpec, a)
                             for a in RoutingSpec.__dataclass_fields__})
    if ro and kind != "pdstack":
        r.problems.append(f"spec.router.routing is pdstack's router's; accepted with router kind '{kind}': "
                          "sglang-router's own flags in spec.router.args (e.g. --policy cache_aware)")
    return routing


def _engine_sections(r: _Reader, d: Mapping[str, Any], engine: str) -> tuple[SglangSpec, VllmSpec, str | None]:
    """spec.sglang, spec.vllm (each only with its engine) and spec.runtimeImage (required with the agent)."""
    sg = r.obj(d.get("sglang"), "spec.sglang")
    sglang = SglangSpec(
        transfer_backend=r.take(sg, "spec.sglang", SglangSpec, "transfer_backend"),
        ib_device=r.str_(sg, "ibDevice", "spec.sglang"),
        rdma_resources=r.str_map(sg, "rdmaResources", "spec.sglang"),
    )
    vl = r.obj(d.get("vllm"), "spec.vllm")
    vllm = VllmSpec(**{a: r.take(vl, "spec.vllm", VllmSpec, a) for a in VllmSpec.__dataclass_fields__})
    for key, given in (("sglang", sg), ("vllm", vl)):
        if given and engine != key:
            r.problems.append(f"spec.{key} is set but spec.engine is '{engine}'; accepted: spec.{key} only with "
                              f"engine '{key}'")
    runtime_image = r.take(d, "spec", PDSpec, "runtime_image")
    if engine in AGENT_ENGINES and not runtime_image:
        r.problems.append(f"spec.runtimeImage is required with engine '{engine}'; accepted: the pdstack runtime "
                          "image (its agent sidecar serves /config and /metrics beside the engine, and pdstack's "
                          "router runs it)")
    return sglang, vllm, runtime_image


def parse_spec(raw: Any, *, name: str | None = None) -> PDSpec:
    """Validate and default a PDDeployment ``spec``; raise :class:`SpecError` with every problem."""
    r = _Reader()
    if name is not None and (len(name) > MAX_NAME_LEN or not _DNS_LABEL.match(name)):
        r.fail("metadata.name", name, f"a DNS label of at most {MAX_NAME_LEN} characters")
    d = r.obj(raw, "spec")
    image = r.str_(d, "image", "spec", required=True) or ""
    engine = r.take(d, "spec", PDSpec, "engine")
    model = _model(r, d, engine)
    pairs = r.take(d, "spec", PDSpec, "pairs")
    shared = _pod_template(r, r.obj(d.get("podTemplate"), "spec.podTemplate"), "spec.podTemplate")
    if shared.image:
        r.problems.append("spec.podTemplate.image is not a field; accepted: spec.image (workers) and "
                          "spec.<role>.image (per role)")
    prefill, decode, router = (_role(r, d.get(role), f"spec.{role}", section_of(PDSpec, role))
                               for role in ("prefill", "decode", "router"))
    prefill, decode, router = (replace(x, pod=x.pod.over(shared)) for x in (prefill, decode, router))
    for role, x in (("prefill", prefill), ("decode", decode), ("router", router)):
        for i, c in enumerate(x.pod.containers):
            if c.get("name") == role:
                r.fail(f"spec.{role}.containers[{i}].name", role, "a name other than the operator's container")
    sglang, vllm, runtime_image = _engine_sections(r, d, engine)
    pr = r.obj(d.get("probes"), "spec.probes")
    probes = Probes(**{a: r.take(pr, "spec.probes", Probes, a) for a in Probes.__dataclass_fields__})
    if prefill.tp_size != decode.tp_size:
        r.problems.append(f"spec.prefill tensor-parallel size {prefill.tp_size} differs from spec.decode's "
                          f"{decode.tp_size} (from tensorParallelSize, else resources.gpus); KV transfer moves one "
                          "shard per rank, so accepted: equal sizes on both sides of a pair")
    _check_weights(r, model, engine, prefill, decode)

    p = r.obj(d.get("placement"), "spec.placement")
    placement = Placement(
        group_placement=r.take(p, "spec.placement", Placement, "group_placement"),
        node_selector=r.str_map(p, "nodeSelector", "spec.placement"),
        tolerations=r.list_of_obj(p, "tolerations", "spec.placement"),
        affinity=r.obj(p.get("affinity"), "spec.placement.affinity"),
        priority_class_name=r.str_(p, "priorityClassName", "spec.placement"),
    )
    k = r.obj(d.get("kernel"), "spec.kernel")
    kernel = KernelKnobs(**{a: r.take(k, "spec.kernel", KernelKnobs, a) for a in KernelKnobs.__dataclass_fields__})
    watchdog, co = _watchdog(r, d), _co_restart(r, d)
    dr = r.obj(d.get("drift"), "spec.drift")
    ro = r.obj(d.get("rollout"), "spec.rollout")
    rollout = _rollout(r, ro)
    st = r.obj(d.get("stall"), "spec.stall")
    stall = StallSpec(seconds=r.take(st, "spec.stall", StallSpec, "seconds"))
    router_kind = _router_kind(r, d, engine)
    routing = _routing(r, d, router_kind)
    router_processes = _router_processes(r, d, router_kind)
    prefix_cache = _prefix_cache(r, d, engine)
    spec = PDSpec(
        image=image,
        engine=engine,
        model=model,
        pairs=pairs,
        prefill=prefill,
        decode=decode,
        router=router,
        placement=placement,
        kernel=kernel,
        watchdog=watchdog,
        co_restart=co,
        drift_policy=r.take(dr, "spec.drift", PDSpec, "drift_policy"),
        max_unavailable_pairs=r.take(ro, "spec.rollout", PDSpec, "max_unavailable_pairs"),
        drain_seconds=r.take(ro, "spec.rollout", PDSpec, "drain_seconds"),
        revision_history_limit=r.take(d, "spec", PDSpec, "revision_history_limit"),
        probes=probes,
        sglang=sglang,
        vllm=vllm,
        runtime_image=runtime_image,
        router_kind=router_kind,
        router_processes=router_processes,
        rollout=rollout,
        stall=stall,
        routing=routing,
        prefix_cache=prefix_cache,
    )
    if r.problems:
        raise SpecError(r.problems)
    return spec
