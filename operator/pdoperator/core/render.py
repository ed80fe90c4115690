"""render: spec + revision -> the child objects of a PDDeployment (pure; no API calls).

Children: one Pod per pair and role (created directly, not through a StatefulSet, so the
operator alone decides when a pair restarts), a headless worker Service (stable DNS per pod
via hostname/subdomain), the router Deployment and Service, the router topology ConfigMap,
the KV-transfer auth Secret (workers only), the router-admin Secret (router only: it guards the
router's /config, /debug and the operator's topology pushes), a NetworkPolicy and a PodDisruptionBudget. Every child carries an
owner reference to the PDDeployment, so deleting it deletes them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import yaml

from .engines import kernel_mapping, vllm_kv_lease_s
from .spec import (AGENT_PORT, BOOTSTRAP_PORT, GPU_RESOURCE, GROUP, HTTP_PORT, KIND, VERSION, VLLM_KV_CONNECTOR,
                   WORKER_UID, ModelSpec, PDSpec, PodTemplate, RoleSpec, RoutingSpec, default_of)

LABEL_DEPLOYMENT = "pdstack.io/deployment"
LABEL_PAIR = "pdstack.io/pair"
LABEL_ROLE = "pdstack.io/role"
LABEL_REVISION = "pdstack.io/revision"
LABEL_COMPONENT = "pdstack.io/component"  # worker | router
LABEL_MEMBER = "pdstack.io/member"  # which prefill (decode) of its group: 0..replicas-1
ROLES = ("prefill", "decode")
# A group's router entries: one per (prefill, decode) combination; entry c of group k has index k + STRIDE * c,
# so a 1P:1D group keeps index k and index % STRIDE is always the group (spec.pairs <= 256 < STRIDE).
GROUP_INDEX_STRIDE = 1000
TOPOLOGY_KEY = "topology.yaml"
TOPOLOGY_DIR = "/etc/pdstack"
KV_AUTH_DIR = "/etc/pdstack/kv-auth"
KV_AUTH_KEY = "token"
ADMIN_DIR = "/etc/pdstack/router-admin"
ADMIN_KEY = "token"


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


@dataclass(frozen=True)
class TopologyPair:
    """One P:D group as the router sees it (a pair is the 1P:1D group)."""

    index: int
    ready: bool
    prefill_host: str | None  # pod IP (or DNS name) of the prefill worker (member 0)
    decode_host: str | None
    draining: bool = False  # take no new requests; the pods go once the router confirms
    prefill_hosts: tuple[str | None, ...] = ()  # every prefill member (default: (prefill_host,))
    decode_hosts: tuple[str | None, ...] = ()
    canary: bool = False  # a new revision on trial: no normal traffic, only requests pinned to it (the probe's)

    def members(self) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
        return (self.prefill_hosts or (self.prefill_host,)), (self.decode_hosts or (self.decode_host,))


def slot_name(role: str, member: int) -> str:
    """A pod's place in its group: ``prefill``/``decode`` for member 0 (the 1P:1D names), ``decode-2``..."""
    return role if member == 0 else f"{role}-{member}"


def split_slot(slot: str) -> tuple[str, int]:
    role, _, member = slot.partition("-")
    return role, int(member or 0)


def group_slots(prefill: int, decode: int) -> tuple[str, ...]:
    """Every member of a ``prefill``P:``decode``D group, prefills first."""
    return tuple(slot_name("prefill", m) for m in range(prefill)) + tuple(slot_name("decode", m) for m in range(decode))


def group_of(router_index: int) -> int:
    """The group a router topology entry belongs to."""
    return router_index % GROUP_INDEX_STRIDE


# ---------------------------------------------------------------- names
def workers_service_name(name: str) -> str:
    return f"{name}-workers"


def router_name(name: str) -> str:
    return f"{name}-router"


def topology_name(name: str) -> str:
    return f"{name}-topology"


def kv_secret_name(name: str) -> str:
    return f"{name}-kv-auth"


def admin_secret_name(name: str) -> str:
    return f"{name}-router-admin"


def worker_hostname(name: str, pair: int, slot: str) -> str:
    return f"{name}-{pair}-{slot}"


def worker_dns(owner: Owner, pair: int, slot: str) -> str:
    return f"{worker_hostname(owner.name, pair, slot)}.{workers_service_name(owner.name)}.{owner.namespace}.svc"


def pod_name(name: str, pair: int, slot: str, suffix: str) -> str:
    return f"{worker_hostname(name, pair, slot)}-{suffix}"


def _meta(owner: Owner, name: str, labels: Mapping[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": {"app.kubernetes.io/name": "pdstack", "app.kubernetes.io/managed-by": "pdstack-operator",
                   LABEL_DEPLOYMENT: owner.name, **(labels or {})},
        "ownerReferences": [owner.reference()],
    }
    meta.update(extra)
    return meta


# ---------------------------------------------------------------- command lines
def worker_command(spec: PDSpec, owner: Owner, role: str) -> list[str]:
    """The container command of a prefill/decode worker for the spec's engine (then the role's args)."""
    r: RoleSpec = spec.prefill if role == "prefill" else spec.decode
    if spec.engine == "sglang":
        return sglang_command(spec, role, r) + list(r.args)
    if spec.engine == "vllm":
        return vllm_command(spec, r) + list(r.args)
    cmd = ["pdrt", "serve", "--role", role, "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    if role == "prefill":
        cmd += ["--bootstrap-port", str(BOOTSTRAP_PORT)]
    if spec.model.source:
        cmd += ["--model", spec.model.source]
    if spec.model.served_name:
        cmd += ["--served-model-name", spec.model.served_name]
    cmd += ["--device", r.device, "--dtype", spec.model.dtype, "--tensor-parallel-size", str(r.tp_size)]
    if spec.model.weights != default_of(ModelSpec, "weights"):  # unset renders the command it always did
        cmd += ["--weights", spec.model.weights]
    if not spec.prefix_cache.enabled:
        cmd += ["--no-prefix-cache"]
    elif spec.prefix_cache.max_pages is not None:
        cmd += ["--prefix-cache-max-pages", str(spec.prefix_cache.max_pages)]
    return cmd + list(r.args)


def sglang_command(spec: PDSpec, role: str, r: RoleSpec) -> list[str]:
    """``python -m sglang.launch_server`` (flags: sglang/srt/server_args.py)."""
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(spec.model.source),
           "--disaggregation-mode", role, "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    if spec.model.served_name:
        cmd += ["--served-model-name", spec.model.served_name]
    if role == "prefill":
        cmd += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    # explicit: SGLang's default (mooncake over RDMA) fails on nodes without an RDMA device
    cmd += ["--disaggregation-transfer-backend", spec.sglang.transfer_backend]
    if spec.sglang.ib_device:
        cmd += ["--disaggregation-ib-device", spec.sglang.ib_device]
    if r.tp_size > 1:
        cmd += ["--tp-size", str(r.tp_size)]
    if spec.model.dtype != "auto":
        cmd += ["--dtype", ENGINE_DTYPES[spec.model.dtype]]
    if not spec.prefix_cache.enabled:
        cmd += ["--disable-radix-cache"]
    # --enable-metrics: its /metrics, which the agent translates (off by default in SGLang)
    return cmd + _kernel_flags(spec) + ["--enable-metrics"]


def _kernel_flags(spec: PDSpec) -> list[str]:
    """The engine's own flags for the spec.kernel knobs set away from their defaults (engines.py)."""
    mapping = kernel_mapping(spec)
    return list(mapping.flags) if mapping is not None else []


# spec.model.dtype -> the name SGLang's and vLLM's --dtype take (both: auto, half, float16, bfloat16, float, float32)
ENGINE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_kv_transfer_config(spec: PDSpec) -> str:
    """vLLM's PD connector as llm-d deploys it: NIXL, both sides kv_both (the router's kv_transfer_params pick the
    roles), and prefill's KV lease from spec.watchdog.transferTimeoutSeconds (engines.py)."""
    return json.dumps({"kv_connector": VLLM_KV_CONNECTOR, "kv_role": "kv_both",
                       "kv_connector_extra_config": {"kv_lease_duration": vllm_kv_lease_s(spec)}},
                      separators=(",", ":"))


def vllm_command(spec: PDSpec, r: RoleSpec) -> list[str]:
    """``vllm serve MODEL`` (flags: vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py). Prefill and
    decode run the same line: with kv_role kv_both the request's kv_transfer_params say which side a worker is."""
    v = spec.vllm
    cmd = ["vllm", "serve", str(spec.model.source), "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    if spec.model.served_name:
        cmd += ["--served-model-name", spec.model.served_name]
    cmd += ["--tensor-parallel-size", str(r.tp_size)]
    if spec.model.dtype != "auto":
        cmd += ["--dtype", ENGINE_DTYPES[spec.model.dtype]]
    cmd += ["--kv-transfer-config", vllm_kv_transfer_config(spec)]
    if not spec.prefix_cache.enabled:
        cmd += ["--no-enable-prefix-caching"]
    if v.max_model_len is not None:
        cmd += ["--max-model-len", str(v.max_model_len)]
    if v.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", _num(v.gpu_memory_utilization)]
    if v.enforce_eager:
        cmd += ["--enforce-eager"]
    return cmd + _kernel_flags(spec)


def agent_command(spec: PDSpec, role: str) -> list[str]:
    """The pdstack agent beside the engine (``pdrt agent``, runtime/pdruntime/cli.py): /config from the engine
    process's env, /metrics and /debug/requests translated from the engine's /metrics."""
    cmd = ["pdrt", "agent", "--engine", spec.engine, "--role", role, "--host", "0.0.0.0", "--port", str(AGENT_PORT),
           "--engine-url", f"http://127.0.0.1:{HTTP_PORT}"]
    if spec.model.source and spec.model.source.startswith("/"):  # a path, not a hub id: its weights get hashed
        cmd += ["--model-path", spec.model.source]
    if spec.engine == "vllm":  # SGLANG_* is a family /config always reports; VLLM_* is vLLM's
        cmd += ["--report-env", "VLLM_*"]
    return cmd


def router_command(spec: PDSpec, owner: Owner) -> list[str]:
    if spec.router_kind == "sglang":
        # SGLang's router takes a static list; worker DNS names are stable across co-restarts.
        cmd = ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for k in range(spec.pairs):
            for m in range(spec.prefill.replicas):
                cmd += ["--prefill", f"http://{worker_dns(owner, k, slot_name('prefill', m))}:{HTTP_PORT}",
                        str(BOOTSTRAP_PORT)]
        for k in range(spec.pairs):
            for m in range(spec.decode.replicas):
                cmd += ["--decode", f"http://{worker_dns(owner, k, slot_name('decode', m))}:{HTTP_PORT}"]
        return cmd + ["--host", "0.0.0.0", "--port", str(HTTP_PORT)] + list(spec.router.args)
    # pdstack's router for every engine: SGLang's and vLLM's workers in their own protocol, their evidence
    # (/debug/requests) from the agent beside each
    protocol = ["--worker-protocol", spec.engine, "--worker-agent-port", str(AGENT_PORT)] if spec.has_agent else []
    return (["pdrt", "serve", "--role", "router", "--host", "0.0.0.0", "--port", str(HTTP_PORT),
             "--topology-file", f"{TOPOLOGY_DIR}/{TOPOLOGY_KEY}",
             "--admin-token-file", f"{ADMIN_DIR}/{ADMIN_KEY}"] + protocol + routing_args(spec.routing)
            + (["--router-processes", str(spec.router_processes)] if spec.router_processes != 1 else [])
            + list(spec.router.args))


ROUTING_FLAGS = {"policy": "--routing-policy", "balance_abs_threshold": "--balance-abs-threshold",
                 "balance_rel_threshold": "--balance-rel-threshold", "cache_threshold": "--cache-threshold",
                 "prefix_tree_max_chars": "--prefix-tree-max-chars"}


def routing_args(routing: RoutingSpec) -> list[str]:
    """pdrt router flags for spec.router.routing: only the fields that differ from their defaults (the router's
    own), so a spec without routing renders the router it always did."""
    out: list[str] = []
    for attr, flag in ROUTING_FLAGS.items():
        value = getattr(routing, attr)
        if value != default_of(RoutingSpec, attr):
            out += [flag, str(value)]
    return out


def worker_env(spec: PDSpec, role: str) -> list[dict[str, Any]]:
    """Env of a worker: operator-owned knobs first (from typed fields), then the user's env."""
    r = spec.prefill if role == "prefill" else spec.decode
    if spec.engine == "vllm":  # vLLM reads none of pdrt's knobs: its NIXL side channel (vllm/envs.py)
        return [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(spec.vllm.nixl_side_channel_port)}
                ] + user_env(r)
    # the decode kernel's CTA target is a decode knob, set only when given (unset = 0 = derive from the
    # device, the runtime's default), so that a diff of two revisions reads ``<unset> -> 512``
    env = ([{"name": "PDRT_DECODE_TARGET_CTAS", "value": str(spec.kernel.decode_target_ctas)}]
           if role == "decode" and spec.kernel.decode_target_ctas else []) + [
        {"name": "PDRT_MAX_KV_SPLITS", "value": str(spec.kernel.max_kv_splits)},
        {"name": "PDRT_ATTENTION_BACKEND", "value": spec.kernel.attention_backend},
        {"name": "PDRT_BOOTSTRAP_TIMEOUT_S", "value": _num(spec.watchdog.bootstrap_timeout_s)},
        {"name": "PDRT_TRANSFER_TIMEOUT_S", "value": _num(spec.watchdog.transfer_timeout_s)},
        {"name": "PDRT_DECODE_TRANSFER_TIMEOUT_S", "value": _num(spec.watchdog.decode_transfer_timeout_s)},
        {"name": "PDRT_PREFILL_STALL_S", "value": _num(spec.watchdog.prefill_stall_s)},
        {"name": "PDRT_WATCHDOG_TICK_S", "value": _num(spec.watchdog.tick_s)},
        {"name": "PDRT_KV_AUTH_TOKEN_FILE", "value": f"{KV_AUTH_DIR}/{KV_AUTH_KEY}"},
    ]
    if spec.model.source:
        env.append({"name": "PDRT_MODEL", "value": spec.model.source})
    return env + user_env(r)


def user_env(r: RoleSpec) -> list[dict[str, Any]]:
    """The user's env as rendered: literal values, or ``valueFrom`` references (never resolved here)."""
    return [{"name": n, **v} if isinstance(v, Mapping) else {"name": n, "value": v} for n, v in r.env]


def _num(x: float) -> str:
    return repr(int(x)) if float(x).is_integer() else repr(x)


def _resources(r: RoleSpec, extended: Mapping[str, str] | None = None) -> dict[str, Any]:
    requests, limits = dict(r.requests), dict(r.limits)
    if r.gpus:
        requests[GPU_RESOURCE] = str(r.gpus)
        limits[GPU_RESOURCE] = str(r.gpus)
    for k, v in (extended or {}).items():  # extended resources (RDMA devices): requests == limits
        requests[k] = limits[k] = v
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    return out


HOSTNAME_KEY = "kubernetes.io/hostname"


def group_affinity(spec: PDSpec, owner: Owner, pair: int) -> dict[str, Any]:
    """The default placement of group ``pair``: its pods together on one node (the KV transfer stays on the
    node), other groups elsewhere (a node failure takes one group). ``Preferred`` (default) lets the scheduler
    break either rule when it must; ``Required`` makes co-location mandatory (a group that fits no single node
    stays Pending); ``None`` renders neither."""
    mode = spec.placement.group_placement
    if mode == "None":
        return {}
    same = {"labelSelector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker",
                                              LABEL_PAIR: str(pair)}}, "topologyKey": HOSTNAME_KEY}
    others = {"labelSelector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker"},
                                "matchExpressions": [{"key": LABEL_PAIR, "operator": "NotIn", "values": [str(pair)]}]},
              "topologyKey": HOSTNAME_KEY}
    together = ({"requiredDuringSchedulingIgnoredDuringExecution": [same]} if mode == "Required" else
                {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": same}]})
    return {"podAffinity": together,
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 50, "podAffinityTerm": others}]}}


def _placement(spec: PDSpec) -> dict[str, Any]:
    p = spec.placement
    out: dict[str, Any] = {}
    if p.node_selector:
        out["nodeSelector"] = dict(p.node_selector)
    if p.tolerations:
        out["tolerations"] = [dict(t) for t in p.tolerations]
    if p.affinity:
        out["affinity"] = dict(p.affinity)
    if p.priority_class_name:
        out["priorityClassName"] = p.priority_class_name
    return out


def _probe(path: str, period: int, failures: int, timeout: int = 1) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


# ---------------------------------------------------------------- secure defaults
# Pod Security "restricted" by default; every key can be overridden by spec.<role>.securityContext /
# podSecurityContext (or spec.podTemplate.*), merged key by key over these.
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                      "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                      "seccompProfile": {"type": "RuntimeDefault"}}
POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
# Writable paths under a read-only root: the images point HOME, XDG_CACHE_HOME, HF_HOME, TRITON_CACHE_DIR and
# TORCHINDUCTOR_CACHE_DIR under /tmp (images/runtime/Dockerfile), so one emptyDir covers every cache.
SCRATCH_VOLUME = {"name": "tmp", "emptyDir": {}}
SCRATCH_MOUNT = {"name": "tmp", "mountPath": "/tmp"}
SHM_MOUNT = "/dev/shm"


def container_security(pod: PodTemplate) -> dict[str, Any]:
    return copy.deepcopy({**CONTAINER_SECURITY, **pod.security_context})


def pod_security(pod: PodTemplate) -> dict[str, Any]:
    return copy.deepcopy({**POD_SECURITY, **pod.pod_security_context})


def readiness_timeout(spec: PDSpec) -> int:
    """Seconds one /health probe may take: SGLang's /health runs a one-token generation, pdrt's is a lookup."""
    if spec.probes.readiness_timeout_s is not None:
        return spec.probes.readiness_timeout_s
    return READINESS_TIMEOUT_S[spec.engine]


# seconds: SGLang's /health runs a one-token generation; vLLM's asks its engine-core process (IPC); pdrt's a lookup
READINESS_TIMEOUT_S = {"pdrt": 2, "sglang": 10, "vllm": 5}


STARTUP_PERIOD_S = 10


def worker_probes(spec: PDSpec) -> dict[str, Any]:
    """startupProbe (the model-load budget), readiness and liveness (which the kubelet only starts once the
    startup probe succeeded, so a slow model load never trips it), and a preStop drain."""
    p, timeout = spec.probes, readiness_timeout(spec)
    return {
        # failureThreshold * periodSeconds >= startupSeconds: the load may take that long before a restart
        "startupProbe": _probe("/health", STARTUP_PERIOD_S, -(-p.startup_s // STARTUP_PERIOD_S), timeout),
        "readinessProbe": _probe("/health", 5, 3, timeout),
        # a hung engine (no /health answer, or 503 unhealthy) restarts after period * failures seconds; a long
        # busy step does not: /health is answered by the HTTP loop, not the engine step
        "livenessProbe": _probe("/health", p.liveness_period_s, p.liveness_failures, timeout),
        **({"lifecycle": {"preStop": {"exec": {"command": ["sleep", str(p.drain_s)]}}}} if p.drain_s else {}),
    }


def termination_grace(spec: PDSpec, pod: PodTemplate) -> int:
    """The preStop drain plus 30 s for the process's own SIGTERM shutdown, unless set explicitly."""
    if pod.termination_grace_period_s is not None:
        return pod.termination_grace_period_s
    return spec.probes.drain_s + 30


def pod_template_fields(pod: PodTemplate, *, worker: bool) -> dict[str, Any]:
    """PodSpec fields from the role's template (placement, identity, pull secrets) and the secure defaults."""
    out: dict[str, Any] = {"securityContext": pod_security(pod)}
    if pod.service_account_name:
        out["serviceAccountName"] = pod.service_account_name
    automount = pod.automount_service_account_token
    # workers never talk to the API server; the router neither, but a user sidecar might (set it true)
    out["automountServiceAccountToken"] = bool(automount) if automount is not None else False
    if pod.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in pod.image_pull_secrets]
    if pod.node_selector:
        out["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = [dict(t) for t in pod.tolerations]
    if pod.affinity:
        out["affinity"] = dict(pod.affinity)
    if pod.topology_spread_constraints:
        out["topologySpreadConstraints"] = [dict(t) for t in pod.topology_spread_constraints]
    if pod.priority_class_name:
        out["priorityClassName"] = pod.priority_class_name
    return out


MODEL_VOLUME = "model"
# The download init container: stdlib only, so any image with python3 works. Skips a file already there with
# the expected hash (restarts and other groups' pods sharing a PVC do not download again); verifies the hash.
DOWNLOAD_SCRIPT = """\
import hashlib, os, sys, urllib.request
url, dest, want = sys.argv[1], sys.argv[2], sys.argv[3] or None
def digest(p):
    h = hashlib.sha256()
    with open(p, 'rb') as f:
        for b in iter(lambda: f.read(1 << 20), b''):
            h.update(b)
    return h.hexdigest()
if os.path.exists(dest) and (want is None or digest(dest) == want):
    sys.exit(0)
os.makedirs(os.path.dirname(dest), exist_ok=True)
urllib.request.urlretrieve(url, dest + '.part')
if want is not None and digest(dest + '.part') != want:
    sys.exit(f'{url}: sha256 mismatch, expected {want}')
os.replace(dest + '.part', dest)
"""


def model_volume(spec: PDSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, worker mounts, init containers) for spec.model.storage; empty without it."""
    st = spec.model.storage
    if st is None:
        return [], [], []
    from .spec import MODEL_STORAGE_KINDS
    vol: dict[str, Any] = {"name": MODEL_VOLUME}
    if st.kind == "emptyDir":
        vol["emptyDir"] = {"sizeLimit": st.download_size} if st.download_size else {}
    else:
        vol[MODEL_STORAGE_KINDS[st.kind]] = dict(st.source)
    mounts = [{"name": MODEL_VOLUME, "mountPath": st.mount_path, "readOnly": True}]
    init: list[dict[str, Any]] = []
    if st.download_url:
        dest = spec.model.source or f"{st.mount_path.rstrip('/')}/{st.download_url.rsplit('/', 1)[-1]}"
        init.append({"name": "model-download", "image": spec.prefill.pod.image or spec.image,
                     "command": ["python3", "-c", DOWNLOAD_SCRIPT, st.download_url, dest, spec.model.sha256 or ""],
                     "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": st.mount_path},
                                      dict(SCRATCH_MOUNT)],
                     "securityContext": copy.deepcopy(CONTAINER_SECURITY)})
    return [vol], mounts, init


def scratch_volumes(pod: PodTemplate) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): /tmp always (read-only root), /dev/shm when sharedMemorySize is set."""
    vols, mounts = [dict(SCRATCH_VOLUME)], [dict(SCRATCH_MOUNT)]
    if pod.shared_memory_size:
        vols.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": pod.shared_memory_size}})
        mounts.append({"name": "dshm", "mountPath": SHM_MOUNT})
    return vols, mounts


def sidecars(pod: PodTemplate) -> list[dict[str, Any]]:
    """The user's extra containers, with the secure container defaults under their own securityContext."""
    return [copy.deepcopy({**dict(c), "securityContext": {**CONTAINER_SECURITY, **(c.get("securityContext") or {})}})
            for c in pod.containers]


def _container_image(container: dict[str, Any], image: str, pod: PodTemplate) -> dict[str, Any]:
    container["image"] = image
    if pod.image_pull_policy:
        container["imagePullPolicy"] = pod.image_pull_policy
    return container


AGENT_CONTAINER = "pdstack-agent"
# the agent: a stdlib HTTP server reading /proc and the engine's /metrics (hashing the weights once, streamed)
AGENT_RESOURCES = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}}


def agent_container(spec: PDSpec, role: str, pod: PodTemplate, uid: int,
                    mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``pdstack-agent`` sidecar of an SGLang or vLLM worker: the runtime image, non-root as ``uid`` (the
    engine container's), the restricted container defaults, ready once it has found the engine process."""
    c = _container_image({"name": AGENT_CONTAINER}, str(spec.runtime_image), pod)
    c.update({"command": agent_command(spec, role),
              "ports": [{"name": "agent", "containerPort": AGENT_PORT}],
              "readinessProbe": {"httpGet": {"path": "/health", "port": "agent"}, "periodSeconds": 5,
                                 "failureThreshold": 3, "timeoutSeconds": 2},
              "resources": copy.deepcopy(AGENT_RESOURCES),
              "securityContext": {**copy.deepcopy(CONTAINER_SECURITY), "runAsUser": uid},
              "volumeMounts": copy.deepcopy(mounts)})
    return c


# ---------------------------------------------------------------- children
def worker_pod(spec: PDSpec, owner: Owner, revision: str, pair: int, slot: str, suffix: str) -> dict[str, Any]:
    """One worker Pod of group ``pair`` at ``slot`` (``prefill``, ``decode``, ``decode-1``...); ``suffix`` makes
    the name unique per incarnation."""
    role, member = split_slot(slot)
    r = spec.prefill if role == "prefill" else spec.decode
    pod = r.pod
    ports = [{"name": "http", "containerPort": HTTP_PORT}]
    if role == "prefill":
        ports.append({"name": "bootstrap", "containerPort": BOOTSTRAP_PORT})
    labels = {**pod.labels, LABEL_COMPONENT: "worker", LABEL_PAIR: str(pair), LABEL_ROLE: role,
              LABEL_REVISION: revision, **({LABEL_MEMBER: str(member)} if member else {})}
    scratch, scratch_mounts = scratch_volumes(pod)
    model_vols, model_mounts, model_init = model_volume(spec)
    container: dict[str, Any] = _container_image({"name": role}, pod.image or spec.image, pod)
    container.update({
        "command": worker_command(spec, owner, role),
        "env": worker_env(spec, role),
        **({"envFrom": [dict(e) for e in pod.env_from]} if pod.env_from else {}),
        "ports": ports,
        **worker_probes(spec),
        "securityContext": container_security(pod),
        "volumeMounts": [{"name": "kv-auth", "mountPath": KV_AUTH_DIR, "readOnly": True}] + scratch_mounts
        + model_mounts + [dict(m) for m in r.volume_mounts],
    })
    res = _resources(r, spec.sglang.rdma_resources if spec.engine == "sglang" else None)
    if res:
        container["resources"] = res
    agent: list[dict[str, Any]] = []
    pod_fields = pod_template_fields(pod, worker=True)
    if spec.has_agent:
        # the agent reads the engine's /proc/PID/environ: the same UID for both (a pod-level runAsUser alone
        # would not hold against a container-level override of the engine's)
        uid = container["securityContext"].get("runAsUser", pod_fields["securityContext"].get("runAsUser",
                                                                                            WORKER_UID))
        pod_fields["securityContext"].setdefault("runAsUser", uid)
        container["securityContext"]["runAsUser"] = uid
        # the weights it hashes for /config: the model volume and the role's own mounts, read-only
        mounts = scratch_mounts[:1] + model_mounts + [{**m, "readOnly": True} for m in r.volume_mounts]
        agent = [agent_container(spec, role, pod, uid, mounts)]
    pod_spec: dict[str, Any] = {
        "hostname": worker_hostname(owner.name, pair, slot),
        "subdomain": workers_service_name(owner.name),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": termination_grace(spec, pod),
        **({"shareProcessNamespace": True} if spec.has_agent else {}),  # the agent finds the engine under /proc
        **({"initContainers": model_init} if model_init else {}),
        "containers": [container] + agent + sidecars(pod),
        "volumes": [{"name": "kv-auth", "secret": {"secretName": kv_secret_name(owner.name)}}] + scratch
        + model_vols + [dict(v) for v in r.volumes],
        **_placement(spec),
        **pod_fields,
    }
    if spec.placement.node_selector and pod.node_selector:  # the role's keys over spec.placement's
        pod_spec["nodeSelector"] = {**spec.placement.node_selector, **pod.node_selector}
    # affinity: the group default, then spec.placement.affinity, then the role's, each winning per kind
    # (nodeAffinity / podAffinity / podAntiAffinity)
    affinity = {**group_affinity(spec, owner, pair), **spec.placement.affinity, **pod.affinity}
    if affinity:
        pod_spec["affinity"] = copy.deepcopy(affinity)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": _meta(owner, pod_name(owner.name, pair, slot, suffix), labels,
                              annotations={**pod.annotations, "pdstack.io/engine": spec.engine}),
            "spec": pod_spec}


def topology_doc(revision: str, pairs: Iterable[TopologyPair], generation: int = 0) -> dict[str, Any]:
    """The router topology (``pdruntime.server.router.topology`` format); ``generation`` is its version."""
    doc: dict[str, Any] = {"version": 1, "generation": generation, "revision": revision, "pairs": []}
    for p in pairs:
        prefills, decodes = p.members()
        grouped = len(prefills) * len(decodes) > 1
        # a group is one router entry per (prefill, decode) combination: the router dispatches within the group
        for c, (ph, dh) in enumerate((ph, dh) for ph in prefills for dh in decodes):
            entry: dict[str, Any] = {"index": p.index + GROUP_INDEX_STRIDE * c,
                                     "ready": bool(p.ready and ph and dh and not p.draining),
                                     "draining": p.draining}
            if grouped:
                entry["group"] = p.index
            if p.canary:
                entry["canary"] = True
            entry["prefill"] = {"url": f"http://{ph}:{HTTP_PORT}" if ph else None,
                                "bootstrap_host": ph, "bootstrap_port": BOOTSTRAP_PORT}
            entry["decode"] = {"url": f"http://{dh}:{HTTP_PORT}" if dh else None}
            doc["pairs"].append(entry)
    return doc


def topology_generation(previous: Mapping[str, Any] | None, doc: Mapping[str, Any]) -> int:
    """The version ``doc`` is published as: the previous one if nothing changed, else one more."""
    if not isinstance(previous, Mapping):
        return 1
    prev_gen = previous.get("generation", 0)
    prev_gen = prev_gen if isinstance(prev_gen, int) and not isinstance(prev_gen, bool) else 0
    same = ({k: v for k, v in previous.items() if k != "generation"}
            == {k: v for k, v in doc.items() if k != "generation"})
    return prev_gen if same and prev_gen > 0 else prev_gen + 1


def topology_yaml(revision: str, pairs: Iterable[TopologyPair], generation: int = 0) -> str:
    """The router topology file (``topology.yaml``) in the cross-component format."""
    return yaml.safe_dump(topology_doc(revision, pairs, generation), sort_keys=False)


def topology_configmap(owner: Owner, revision: str, pairs: Iterable[TopologyPair],
                       generation: int = 0) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(owner, topology_name(owner.name), {LABEL_COMPONENT: "router"}),
            "data": {TOPOLOGY_KEY: topology_yaml(revision, pairs, generation)}}


def kv_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The KV-transfer token: mounted into worker pods only (the router never holds it)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(owner, kv_secret_name(owner.name), {LABEL_COMPONENT: "worker"}),
            "stringData": {KV_AUTH_KEY: token}}


def admin_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The router-admin token: mounted into the router pod only (``--admin-token-file``); the operator
    sends it on ``GET /config`` and ``POST /admin/topology``."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(owner, admin_secret_name(owner.name), {LABEL_COMPONENT: "router"}),
            "stringData": {ADMIN_KEY: token}}


def workers_service(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(owner, workers_service_name(owner.name), {LABEL_COMPONENT: "worker"}),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker"},
                     "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT},
                               {"name": "bootstrap", "port": BOOTSTRAP_PORT, "targetPort": BOOTSTRAP_PORT}]}}


def router_deployment(spec: PDSpec, owner: Owner) -> dict[str, Any]:
    labels = {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "router"}
    admin = spec.pdstack_router  # the router-admin token; the KV-transfer token never reaches the router
    pod = spec.router.pod
    scratch, scratch_mounts = scratch_volumes(pod)
    container: dict[str, Any] = _container_image({"name": "router"}, spec.router_image(), pod)
    container.update({
        "command": router_command(spec, owner),
        "env": user_env(spec.router),
        **({"envFrom": [dict(e) for e in pod.env_from]} if pod.env_from else {}),
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        "readinessProbe": _probe("/health", 5, 3, 2),
        "securityContext": container_security(pod),
        "volumeMounts": [{"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True}]
        + ([{"name": "router-admin", "mountPath": ADMIN_DIR, "readOnly": True}] if admin else [])
        + scratch_mounts + [dict(m) for m in spec.router.volume_mounts],
    })
    res = _resources(spec.router)
    if res:
        container["resources"] = res
    pod_spec: dict[str, Any] = {
        "containers": [container] + sidecars(pod),
        "volumes": [{"name": "topology", "configMap": {"name": topology_name(owner.name)}}]
        + ([{"name": "router-admin", "secret": {"secretName": admin_secret_name(owner.name)}}] if admin else [])
        + scratch + [dict(v) for v in spec.router.volumes],
        **pod_template_fields(pod, worker=False),
    }
    if pod.termination_grace_period_s is not None:
        pod_spec["terminationGracePeriodSeconds"] = pod.termination_grace_period_s
    meta: dict[str, Any] = {"labels": {**pod.labels, "app.kubernetes.io/name": "pdstack", **labels}}
    if pod.annotations:
        meta["annotations"] = dict(pod.annotations)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(owner, router_name(owner.name), {LABEL_COMPONENT: "router"}),
            "spec": {"replicas": spec.router.replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": meta, "spec": pod_spec}}}


def router_service(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(owner, router_name(owner.name), {LABEL_COMPONENT: "router"}),
            "spec": {"selector": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "router"},
                     "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT}]}}


# TCP: SGLang's ZMQ sockets and transfer engines, and NIXL's UCX TCP transport (both engines), bind ports chosen
# at runtime
ENGINE_PEER_PORTS = (1024, 65535)


@dataclass(frozen=True)
class PolicyPeers:
    """Who besides the deployment's own pods may reach its workers' HTTP port: ``NetworkPolicyPeer`` objects
    (``namespaceSelector`` / ``podSelector`` / ``ipBlock``), as the chart's ``networkPolicy`` values give them.

    ``operator``: the operator's pods, which read every worker's ``/config`` (process drift) and ``/metrics``
    (stall and canary evidence) by pod IP; ``prometheus``: the scraper of ``/metrics``. Empty: none admitted
    (then an enforcing CNI drops those reads, and drift and stalls come back as "no evidence")."""

    operator: tuple[Mapping[str, Any], ...] = ()
    prometheus: tuple[Mapping[str, Any], ...] = ()


def network_policy(spec: PDSpec, owner: Owner, peers: PolicyPeers = PolicyPeers()) -> dict[str, Any]:
    """Workers accept traffic from pods of the same PDDeployment (router and peers) on the http and bootstrap
    ports (and the agent's, with SGLang and vLLM: the router reads its /debug/requests), and from ``peers`` (the
    operator, Prometheus) on the http and agent ports only (/config, /metrics). With SGLang and vLLM, the workers
    also reach each other on the ports they open at runtime (SGLang's ZMQ / transfer engines, NIXL over UCX): TCP
    1024-65535, and vLLM's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT), from worker pods of the same
    deployment only."""
    agent = [{"port": AGENT_PORT}] if spec.has_agent else []
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name}}}],
                                      "ports": [{"port": HTTP_PORT}, {"port": BOOTSTRAP_PORT}] + agent}]
    readers = [copy.deepcopy(dict(p)) for p in peers.operator + peers.prometheus]
    if readers:
        ingress.append({"from": readers, "ports": [{"protocol": "TCP", "port": HTTP_PORT}]
                        + [{"protocol": "TCP", **p} for p in agent]})
    workers = [{"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker"}}}]
    if spec.engine == "vllm":  # the NIXL handshake: decode asks prefill's listener for its KV memory descriptors
        ingress.append({"from": copy.deepcopy(workers),
                        "ports": [{"protocol": "TCP", "port": spec.vllm.nixl_side_channel_port}]})
    if spec.has_agent:
        lo, hi = ENGINE_PEER_PORTS
        ingress.append({"from": workers, "ports": [{"protocol": "TCP", "port": lo, "endPort": hi}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(owner, workers_service_name(owner.name), {LABEL_COMPONENT: "worker"}),
            "spec": {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker"}},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def disruption_budget(spec: PDSpec, owner: Owner) -> dict[str, Any]:
    """Voluntary evictions never take more than ``maxUnavailablePairs`` pairs down at once.

    A pair is down as soon as one of its pods is, so the budget is counted in pods: at most
    ``maxUnavailablePairs`` worker pods unavailable. A co-restarted pair stays "down" for the PDB until
    both its new pods are Ready (not-ready pods are unhealthy), so a second eviction waits for it.

    ``unhealthyPodEvictionPolicy: AlwaysAllow``: a pod that is not Ready (crash-looping, stuck loading) may
    always be evicted. Under the default (IfHealthyBudget) one crash-looping pair uses up the budget and then
    blocks every node drain; evicting a pod that serves nothing costs no availability, and the pair's
    co-restart recreates it elsewhere.
    """
    per_group = spec.prefill.replicas + spec.decode.replicas
    min_available = max(0, per_group * spec.pairs - spec.max_unavailable_pairs)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(owner, workers_service_name(owner.name), {LABEL_COMPONENT: "worker"}),
            "spec": {"minAvailable": min_available, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                     "selector": {"matchLabels": {LABEL_DEPLOYMENT: owner.name, LABEL_COMPONENT: "worker"}}}}


def static_children(spec: PDSpec, owner: Owner, revision: str,
                    topology: Iterable[TopologyPair] | None = None, generation: int = 0,
                    peers: PolicyPeers = PolicyPeers()) -> list[dict[str, Any]]:
    """Children other than worker Pods and the Secret (those have their own lifecycles); ``peers``: who else
    reaches the workers (the operator's ``PDSTACK_OPERATOR_NETWORK_PEERS``)."""
    if topology is None:
        topology = [TopologyPair(k, False, None, None, prefill_hosts=(None,) * spec.prefill.replicas,
                                 decode_hosts=(None,) * spec.decode.replicas) for k in range(spec.pairs)]
    return [workers_service(owner), router_deployment(spec, owner), router_service(owner),
            topology_configmap(owner, revision, topology, generation), network_policy(spec, owner, peers),
            disruption_budget(spec, owner)]


def render(spec: PDSpec, owner: Owner, revision: str, *, kv_token: str,
           admin_token: str = "generated-once-by-the-operator", suffix: str = "0",
           peers: PolicyPeers = PolicyPeers()) -> list[dict[str, Any]]:
    """Every child of a fresh PDDeployment: Secrets, pods of every pair, services, router, topology."""
    slots = group_slots(spec.prefill.replicas, spec.decode.replicas)
    pods = [worker_pod(spec, owner, revision, k, slot, suffix) for k in range(spec.pairs) for slot in slots]
    topology = [TopologyPair(k, False, worker_dns(owner, k, "prefill"), worker_dns(owner, k, "decode"),
                             prefill_hosts=tuple(worker_dns(owner, k, s) for s in slots if s.startswith("prefill")),
                             decode_hosts=tuple(worker_dns(owner, k, s) for s in slots if s.startswith("decode")))
                for k in range(spec.pairs)]
    admin = [admin_secret(owner, admin_token)] if spec.pdstack_router else []
    return [kv_secret(owner, kv_token)] + admin + pods + static_children(spec, owner, revision, topology,
                                                                           peers=peers)
