"""Typed, defaulted, validated view of a PDDeployment spec.

``parse_spec(raw)`` turns the ``spec`` dict of a PDDeployment into a frozen :class:`PDSpec`
or raises :class:`SpecError` listing every problem found, each naming the field, the value,
and what would be accepted. The CRD schema catches type/enum/range mistakes at admission;
this module re-checks them (manifests rendered offline never met the API server) and adds
the cross-field rules a schema cannot express.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

GROUP = "pdstack.io"
VERSION = "v1alpha1"
PLURAL = "pddeployments"
KIND = "PDDeployment"

ENGINES = ("pdrt", "sglang")
CO_RESTART_POLICIES = ("Pair", "Never")
DRIFT_POLICIES = ("Report", "Revert")
ATTENTION_BACKENDS = ("auto", "triton", "torch")  # mirrors pdruntime.env.ATTENTION_BACKENDS
DTYPES = ("auto", "bf16", "fp16", "fp32")  # mirrors pdruntime.engine.device.DTYPE_CHOICES
GPU_RESOURCE = "nvidia.com/gpu"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# The router is CPU-only: with engine pdrt it runs pdstack's CPU runtime image unless spec.router.image says
# otherwise (spec.image is typically a CUDA image, gigabytes the router never uses).
CPU_RUNTIME_IMAGE = "ghcr.io/pdstack/runtime:0.1.0"
DEFAULT_STARTUP_SECONDS = 1800  # a 70B+ checkpoint from network storage can take tens of minutes
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")

HTTP_PORT = 8000  # every pdrt/sglang server: HTTP API, /health, /metrics
BOOTSTRAP_PORT = 8998  # prefill: KV-transfer bootstrap

# Env vars the operator derives from typed spec fields; setting them by hand is rejected
# so one knob has one source (and one place in the revision diff).
OPERATOR_OWNED_ENV = {
    "PDRT_DECODE_TARGET_CTAS": "spec.kernel.decodeTargetCTAs",
    "PDRT_MAX_KV_SPLITS": "spec.kernel.maxKVSplits",
    "PDRT_ATTENTION_BACKEND": "spec.kernel.attentionBackend",
    "PDRT_BOOTSTRAP_TIMEOUT_S": "spec.watchdog.bootstrapTimeoutSeconds",
    "PDRT_TRANSFER_TIMEOUT_S": "spec.watchdog.transferTimeoutSeconds",
    "PDRT_DECODE_TRANSFER_TIMEOUT_S": "spec.watchdog.decodeTransferTimeoutSeconds",
    "PDRT_WATCHDOG_TICK_S": "spec.watchdog.tickSeconds",
    "PDRT_KV_AUTH_TOKEN_FILE": "the operator (it mounts the KV-transfer Secret)",
    "PDRT_KV_AUTH_TOKEN": "the operator (it mounts the KV-transfer Secret)",
    "PDRT_MODEL": "spec.model.source",
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_GROUP_REPLICAS = 16  # prefill (decode) pods per group; "-<group>-decode-15-<suffix>" fits a DNS label
MAX_NAME_LEN = 40  # leaves room for "-<pair>-prefill-<suffix>" within 63 chars


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
    mount_path: str = "/models"
    download_url: str | None = None  # an init container fetches it into the volume (clusters with network)
    download_size: str | None = None  # emptyDir sizeLimit for a download


@dataclass(frozen=True)
class ModelSpec:
    source: str | None = None  # path inside the image / mounted volume; None = runtime default model
    served_name: str | None = None
    dtype: str = "auto"  # weights/activations/KV: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32
    sha256: str | None = None  # expected weights hash: recorded in the revision; the download verifies it
    storage: ModelStorage | None = None


@dataclass(frozen=True)
class PodTemplate:
    """Per-role pod fields; each role's own value wins over ``spec.podTemplate`` (the shared default).

    Mappings/lists of Kubernetes types (tolerations, affinity, containers, ...) are kept as the user's
    objects: the CRD schema validates them at admission, Kubernetes at pod creation.
    """

    image: str | None = None
    image_pull_policy: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    automount_service_account_token: bool | None = None  # None = the secure default (False)
    env_from: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str | None = None
    containers: tuple[Mapping[str, Any], ...] = ()  # sidecars, appended after the main container
    shared_memory_size: str | None = None  # a memory-backed emptyDir at /dev/shm of this size limit
    termination_grace_period_s: int | None = None
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

    startup_s: int = DEFAULT_STARTUP_SECONDS  # model-load budget before the kubelet gives up and restarts
    readiness_timeout_s: int | None = None  # None = the engine's default (pdrt 2 s, sglang 10 s: /health generates)
    liveness_period_s: int = 10
    liveness_failures: int = 6  # a hung engine is restarted after period * failures seconds
    drain_s: int = 10  # preStop: stop taking requests and let in-flight ones finish (within the grace period)


@dataclass(frozen=True)
class RoleSpec:
    replicas: int = 1
    gpus: int = 0  # nvidia.com/gpu per pod (requests == limits)
    requests: Mapping[str, str] = field(default_factory=dict)  # cpu / memory
    limits: Mapping[str, str] = field(default_factory=dict)
    env: tuple[tuple[str, Any], ...] = ()  # (name, value or {"valueFrom": {...}}), in declared order
    args: tuple[str, ...] = ()  # appended to the rendered command line
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    tensor_parallel: int | None = None  # set explicitly; None = one rank per GPU (see tp_size)
    pod: PodTemplate = PodTemplate()  # merged with spec.podTemplate at parse time

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
    group_placement: str = "Preferred"  # a group's pods on one node (KV transfer stays local), groups spread
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None


SGLANG_TRANSFER_BACKENDS = ("nixl", "mooncake", "mooncake_tcp", "fake")  # SGLang's own choices, minus NPU ones


@dataclass(frozen=True)
class SglangSpec:
    """engine: sglang only. The KV-transfer backend is always rendered explicitly: SGLang's own default is
    mooncake over RDMA, which fails on a node without an RDMA device."""

    transfer_backend: str = "nixl"  # NIXL over UCX works on TCP; mooncake needs RDMA (ibDevice + rdmaResources)
    ib_device: str | None = None  # --disaggregation-ib-device, e.g. mlx5_0
    rdma_resources: Mapping[str, str] = field(default_factory=dict)  # e.g. {"rdma/ib": "1"}: requests == limits


@dataclass(frozen=True)
class KernelKnobs:
    decode_target_ctas: int = 0  # 0 = derive from the device (SMs x waves)
    max_kv_splits: int = 32
    attention_backend: str = "auto"


@dataclass(frozen=True)
class WatchdogSpec:
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 60.0  # KV-transfer phase only, never the decode phase
    decode_transfer_timeout_s: float = 60.0
    tick_s: float = 0.5


@dataclass(frozen=True)
class CoRestartSpec:
    policy: str = "Pair"
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 300.0

    def backoff(self, streak: int) -> float:
        """Seconds to wait before recreating a pair after its ``streak``-th consecutive co-restart."""
        if streak <= 0:
            return 0.0
        return min(self.backoff_initial_s * (2.0 ** (streak - 1)), self.backoff_max_s)


@dataclass(frozen=True)
class CanarySpec:
    """spec.rollout.canary: a new revision goes to one pair first, which the router takes out of normal traffic;
    the multi-round agent probe (``pdrt probe agents``) runs against it, and only a clean probe promotes it."""

    agents: int = 8  # concurrent agents, each on its own keep-alive connection
    rounds: int = 10  # rounds per agent; each round's context grows by the previous answer and a tool result
    round_timeout_s: float = 60.0  # a round not finished within this is a hang
    max_tokens: int = 16  # completion tokens per round


@dataclass(frozen=True)
class RolloutSpec:
    """spec.rollout beyond pacing: soak, canary and auto-rollback. None of it is part of the revision."""

    soak_s: int = 300  # serving this long with no stall makes a revision lastKnownGood
    canary: CanarySpec | None = None  # None: no canary, every pair rolls as maxUnavailablePairs allows
    auto_rollback: bool = False  # a stall within rollback_window_s of a revision change rolls back to lastKnownGood
    rollback_window_s: int = 900


@dataclass(frozen=True)
class StallSpec:
    """spec.stall: when a pair counts as Stalled (read from its /debug/requests and /metrics)."""

    seconds: float = 60.0  # a live request with no progress for this long (or that old before decode) is stuck


@dataclass(frozen=True)
class PDSpec:
    image: str
    engine: str = "pdrt"
    model: ModelSpec = ModelSpec()
    pairs: int = 1
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()
    router: RoleSpec = RoleSpec()
    placement: Placement = Placement()
    kernel: KernelKnobs = KernelKnobs()
    watchdog: WatchdogSpec = WatchdogSpec()
    co_restart: CoRestartSpec = CoRestartSpec()
    drift_policy: str = "Report"
    max_unavailable_pairs: int = 1
    drain_seconds: float = 30.0  # in-flight requests of a draining pair may finish this long before deletion
    revision_history_limit: int = 10
    probes: Probes = Probes()
    sglang: SglangSpec = SglangSpec()
    rollout: RolloutSpec = RolloutSpec()
    stall: StallSpec = StallSpec()

    def router_image(self) -> str:
        """spec.router.image, else pdstack's CPU runtime image (pdrt), else spec.image (sglang's router)."""
        if self.router.pod.image:
            return self.router.pod.image
        return CPU_RUNTIME_IMAGE if self.engine == "pdrt" else self.image

    @property
    def gpus_per_pair(self) -> int:
        return self.prefill.gpus * self.prefill.replicas + self.decode.gpus * self.decode.replicas


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
            self.fail(f"{path}.{key}", value, f"a number of seconds in [{lo}, {hi}]")
            return default
        return float(value)

    def choice(self, raw: Mapping[str, Any], key: str, path: str, default: str, choices: tuple[str, ...]) -> str:
        value = raw.get(key, default)
        if value not in choices:
            self.fail(f"{path}.{key}", value, " | ".join(choices))
            return default
        return value

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


def _role(r: _Reader, raw: Any, path: str, *, gpu_role: bool) -> RoleSpec:
    d = r.obj(raw, path)
    if gpu_role:  # pods of this role per P:D group (spec.pairs counts groups)
        replicas = r.int_(d, "replicas", path, 1, 1, MAX_GROUP_REPLICAS)
    else:
        replicas = r.int_(d, "replicas", path, 1, 0, 64)
    res = r.obj(d.get("resources"), f"{path}.resources")
    gpus = r.int_(res, "gpus", f"{path}.resources", 0, 0, 64 if gpu_role else 0)
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
    tp = None
    if d.get("tensorParallelSize") is not None:
        tp = r.int_(d, "tensorParallelSize", path, 1, 1, 64)
        if gpus and tp > gpus:
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
    mount = r.str_(d, "mountPath", "spec.model.storage") or "/models"
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
    pull = d.get("imagePullPolicy")
    if pull is not None and pull not in PULL_POLICIES:
        r.fail(f"{path}.imagePullPolicy", pull, " | ".join(PULL_POLICIES))
        pull = None
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
    automount = d.get("automountServiceAccountToken")
    if automount is not None and not isinstance(automount, bool):
        r.fail(f"{path}.automountServiceAccountToken", automount, "true | false")
        automount = None
    grace = None
    if d.get("terminationGracePeriodSeconds") is not None:
        grace = r.int_(d, "terminationGracePeriodSeconds", path, 30, 0, 86400)
    sidecars = r.list_of_obj(d, "containers", path)
    for i, c in enumerate(sidecars):
        if not isinstance(c.get("name"), str) or not _DNS_LABEL.match(c.get("name", "")) \
                or c.get("name") in ("prefill", "decode", "router"):
            r.fail(f"{path}.containers[{i}].name", c.get("name"),
                   "a DNS label other than prefill/decode/router (the operator's own container)")
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


def parse_spec(raw: Any, *, name: str | None = None) -> PDSpec:
    """Validate and default a PDDeployment ``spec``; raise :class:`SpecError` with every problem."""
    r = _Reader()
    if name is not None and (len(name) > MAX_NAME_LEN or not _DNS_LABEL.match(name)):
        r.fail("metadata.name", name, f"a DNS label of at most {MAX_NAME_LEN} characters")
    d = r.obj(raw, "spec")
    image = r.str_(d, "image", "spec", required=True) or ""
    engine = r.choice(d, "engine", "spec", "pdrt", ENGINES)
    m = r.obj(d.get("model"), "spec.model")
    sha = r.str_(m, "sha256", "spec.model")
    if sha is not None and not re.fullmatch(r"[0-9a-f]{64}", sha):
        r.fail("spec.model.sha256", sha, "64 lowercase hex digits")
        sha = None
    model = ModelSpec(source=r.str_(m, "source", "spec.model"), served_name=r.str_(m, "servedName", "spec.model"),
                      dtype=r.choice(m, "dtype", "spec.model", "auto", DTYPES), sha256=sha,
                      storage=_model_storage(r, m.get("storage")))
    if model.storage and model.source and not model.source.startswith(model.storage.mount_path.rstrip("/") + "/"):
        r.problems.append(f"spec.model.source={model.source!r} is outside spec.model.storage.mountPath="
                          f"{model.storage.mount_path!r}; accepted: a path under the mount, e.g. "
                          f"{model.storage.mount_path.rstrip('/')}/model.gguf")
    if engine == "sglang" and not model.source:
        r.problems.append("spec.model.source is required with engine 'sglang'; accepted: a model path or HF id")
    pairs = r.int_(d, "pairs", "spec", 1, 0, 256)
    shared = _pod_template(r, r.obj(d.get("podTemplate"), "spec.podTemplate"), "spec.podTemplate")
    if shared.image:
        r.problems.append("spec.podTemplate.image is not a field; accepted: spec.image (workers) and "
                          "spec.<role>.image (per role)")
    prefill = _role(r, d.get("prefill"), "spec.prefill", gpu_role=True)
    decode = _role(r, d.get("decode"), "spec.decode", gpu_role=True)
    router = _role(r, d.get("router"), "spec.router", gpu_role=False)
    prefill, decode, router = (replace(x, pod=x.pod.over(shared)) for x in (prefill, decode, router))
    for role, x in (("prefill", prefill), ("decode", decode), ("router", router)):
        for i, c in enumerate(x.pod.containers):
            if c.get("name") == role:
                r.fail(f"spec.{role}.containers[{i}].name", role, "a name other than the operator's container")
    sg = r.obj(d.get("sglang"), "spec.sglang")
    sglang = SglangSpec(
        transfer_backend=r.choice(sg, "transferBackend", "spec.sglang", "nixl", SGLANG_TRANSFER_BACKENDS),
        ib_device=r.str_(sg, "ibDevice", "spec.sglang"),
        rdma_resources=r.str_map(sg, "rdmaResources", "spec.sglang"),
    )
    if sg and engine != "sglang":
        r.problems.append("spec.sglang is set but spec.engine is 'pdrt'; accepted: spec.sglang only with engine 'sglang'")
    pr = r.obj(d.get("probes"), "spec.probes")
    probes = Probes(
        startup_s=r.int_(pr, "startupSeconds", "spec.probes", DEFAULT_STARTUP_SECONDS, 10, 86400),
        readiness_timeout_s=(r.int_(pr, "readinessTimeoutSeconds", "spec.probes", 2, 1, 600)
                             if pr.get("readinessTimeoutSeconds") is not None else None),
        liveness_period_s=r.int_(pr, "livenessPeriodSeconds", "spec.probes", 10, 1, 3600),
        liveness_failures=r.int_(pr, "livenessFailureThreshold", "spec.probes", 6, 1, 1000),
        drain_s=r.int_(pr, "preStopDrainSeconds", "spec.probes", 10, 0, 3600),
    )
    if prefill.tp_size != decode.tp_size:
        r.problems.append(f"spec.prefill tensor-parallel size {prefill.tp_size} differs from spec.decode's "
                          f"{decode.tp_size} (from tensorParallelSize, else resources.gpus); KV transfer moves one "
                          "shard per rank, so accepted: equal sizes on both sides of a pair")

    p = r.obj(d.get("placement"), "spec.placement")
    placement = Placement(
        group_placement=r.choice(p, "groupPlacement", "spec.placement", "Preferred", GROUP_PLACEMENTS),
        node_selector=r.str_map(p, "nodeSelector", "spec.placement"),
        tolerations=r.list_of_obj(p, "tolerations", "spec.placement"),
        affinity=r.obj(p.get("affinity"), "spec.placement.affinity"),
        priority_class_name=r.str_(p, "priorityClassName", "spec.placement"),
    )
    k = r.obj(d.get("kernel"), "spec.kernel")
    kernel = KernelKnobs(
        decode_target_ctas=r.int_(k, "decodeTargetCTAs", "spec.kernel", 0, 0, 1 << 16),
        max_kv_splits=r.int_(k, "maxKVSplits", "spec.kernel", 32, 1, 1024),
        attention_backend=r.choice(k, "attentionBackend", "spec.kernel", "auto", ATTENTION_BACKENDS),
    )
    w = r.obj(d.get("watchdog"), "spec.watchdog")
    watchdog = WatchdogSpec(
        bootstrap_timeout_s=r.num(w, "bootstrapTimeoutSeconds", "spec.watchdog", 30.0, 0.01, 86400.0),
        transfer_timeout_s=r.num(w, "transferTimeoutSeconds", "spec.watchdog", 60.0, 0.01, 86400.0),
        decode_transfer_timeout_s=r.num(w, "decodeTransferTimeoutSeconds", "spec.watchdog", 60.0, 0.01, 86400.0),
        tick_s=r.num(w, "tickSeconds", "spec.watchdog", 0.5, 0.001, 60.0),
    )
    for key, value in (("transferTimeoutSeconds", watchdog.transfer_timeout_s),
                       ("decodeTransferTimeoutSeconds", watchdog.decode_transfer_timeout_s),
                       ("bootstrapTimeoutSeconds", watchdog.bootstrap_timeout_s)):
        if value <= watchdog.tick_s:
            r.problems.append(f"spec.watchdog.{key}={value} must exceed spec.watchdog.tickSeconds={watchdog.tick_s}; "
                              "a watchdog cannot fire before its first tick")
    c = r.obj(d.get("coRestart"), "spec.coRestart")
    b = r.obj(c.get("backoff"), "spec.coRestart.backoff")
    co = CoRestartSpec(
        policy=r.choice(c, "policy", "spec.coRestart", "Pair", CO_RESTART_POLICIES),
        backoff_initial_s=r.num(b, "initialSeconds", "spec.coRestart.backoff", 1.0, 0.0, 3600.0),
        backoff_max_s=r.num(b, "maxSeconds", "spec.coRestart.backoff", 300.0, 0.0, 86400.0),
    )
    if co.backoff_initial_s > co.backoff_max_s:
        r.problems.append(f"spec.coRestart.backoff.initialSeconds={co.backoff_initial_s} exceeds "
                          f"maxSeconds={co.backoff_max_s}; accepted: initialSeconds <= maxSeconds")
    dr = r.obj(d.get("drift"), "spec.drift")
    ro = r.obj(d.get("rollout"), "spec.rollout")
    canary = None
    if ro.get("canary") is not None:
        cn = r.obj(ro.get("canary"), "spec.rollout.canary")
        canary = CanarySpec(
            agents=r.int_(cn, "agents", "spec.rollout.canary", 8, 1, 64),
            rounds=r.int_(cn, "rounds", "spec.rollout.canary", 10, 1, 100),
            round_timeout_s=r.num(cn, "roundTimeoutSeconds", "spec.rollout.canary", 60.0, 1.0, 3600.0),
            max_tokens=r.int_(cn, "maxTokens", "spec.rollout.canary", 16, 1, 4096),
        )
    auto = ro.get("autoRollback", False)
    if not isinstance(auto, bool):
        r.fail("spec.rollout.autoRollback", auto, "true | false")
        auto = False
    rollout = RolloutSpec(
        soak_s=r.int_(ro, "soakSeconds", "spec.rollout", 300, 0, 86400),
        canary=canary,
        auto_rollback=auto,
        rollback_window_s=r.int_(ro, "rollbackWindowSeconds", "spec.rollout", 900, 0, 86400),
    )
    st = r.obj(d.get("stall"), "spec.stall")
    stall = StallSpec(seconds=r.num(st, "seconds", "spec.stall", 60.0, 1.0, 86400.0))
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
        drift_policy=r.choice(dr, "policy", "spec.drift", "Report", DRIFT_POLICIES),
        max_unavailable_pairs=r.int_(ro, "maxUnavailablePairs", "spec.rollout", 1, 1, 256),
        drain_seconds=r.num(ro, "drainSeconds", "spec.rollout", 30.0, 0.0, 3600.0),
        revision_history_limit=r.int_(d, "revisionHistoryLimit", "spec", 10, 1, 1000),
        probes=probes,
        sglang=sglang,
        rollout=rollout,
        stall=stall,
    )
    if r.problems:
        raise SpecError(r.problems)
    return spec
