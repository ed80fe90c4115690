"""The cluster around the API emulator: scheduler, kubelets on GPU nodes, the Deployment controller.

One synchronous :meth:`Kubelet.step` per tick (no other coroutine interleaves): schedule pending pods
onto nodes with free GPUs (never onto a lost node), start them, keep readiness, confirm graceful
deletions once the container exited (never on a lost node), and keep Deployments' status (plus,
with ``router_ip``, their pods). Tests drive faults through it: container restarts, OOM kills,
evictions, lost nodes.

Images: the nodes reach no registry, as on kind or an air-gapped cluster. A container runs only when its
image was loaded (:meth:`Kubelet.load`, what ``kind load docker-image`` does) and its pull policy lets the
kubelet use the local copy; otherwise it waits in ``ImagePullBackOff`` (``ErrImageNeverPull`` under
``imagePullPolicy: Never``), and its pod stays Pending and not Ready, as a real kubelet leaves it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import secrets
import time
from typing import Any, Iterable, Mapping

from pdop_k8s_emulator import GPU, PODS, PDEmulator, R, _now

NODES = R("", "v1", "nodes")
DEPLOYMENTS = R("apps", "v1", "deployments")


def image_ref(image: str) -> str:
    """The fully qualified reference a container runtime stores ``image`` under (docker's normalisation):
    ``pdstack-runtime:dev`` is ``docker.io/library/pdstack-runtime:dev``, no tag is ``:latest``."""
    name, digest = image.split("@", 1) if "@" in image else (image, "")
    first, _, rest = name.partition("/")
    if not rest:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    if not digest and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return f"{name}@{digest}" if digest else name


def pull_policy(container: Mapping[str, Any]) -> str:
    """The container's imagePullPolicy, or the API server's default: Always for ``:latest`` (or no tag), else
    IfNotPresent. (kind's docs: a loaded ``:latest`` image is pulled again, and fails without a registry.)"""
    if container.get("imagePullPolicy"):
        return container["imagePullPolicy"]
    image = container.get("image") or ""
    return "IfNotPresent" if "@" in image or not image_ref(image).endswith(":latest") else "Always"


def _pod_gpus(pod: dict[str, Any]) -> int:
    return sum(int((c.get("resources", {}) or {}).get("requests", {}).get(GPU, 0) or 0)
               for c in pod.get("spec", {}).get("containers", []) or [])


def _owned_by_deployment(pod: Mapping[str, Any]) -> bool:
    return any(r.get("kind") == "Deployment" for r in pod["metadata"].get("ownerReferences") or [])


class Kubelet:
    """Simulated scheduler + kubelets on GPU nodes + Deployment controller, ticking in the loop.

    ``auto_ready``: running pods become Ready on their own; tests switch it off to decide when.
    """

    def __init__(self, api: PDEmulator, *, tick: float = 0.02, auto_ready: bool = True, images: Iterable[str] = ()):
        self.api = api
        self.images: set[str] = set()  # loaded into every node (references as image_ref stores them)
        self.load(*images)
        self.tick = tick
        self.auto_ready = auto_ready
        self._ips = itertools.count(10)
        self._task: asyncio.Task[None] | None = None
        self.not_ready: set[str] = set()  # pod names held not ready (e.g. just restarted)
        self.down_nodes: set[str] = set()
        self.router_ip: str | None = None  # set: Deployments get pods with this IP (a real router on loopback)

    def load(self, *images: str) -> None:
        """``kind load docker-image IMAGE...``: the images are on every node; pods waiting for them start."""
        self.images.update(image_ref(i) for i in images)

    def image_problem(self, container: Mapping[str, Any]) -> tuple[str, str] | None:
        """(waiting reason, message) when the kubelet cannot start ``container`` for its image, else None."""
        image = container.get("image")
        if not image:
            return None  # the API server refuses such a container at admission: nothing for the kubelet to decide
        present = image_ref(image) in self.images
        policy = pull_policy(container)
        if policy == "Never":
            return None if present else (
                "ErrImageNeverPull", f'Container image "{image}" is not present with pull policy of Never')
        if policy == "IfNotPresent" and present:
            return None
        return "ImagePullBackOff", f'Back-off pulling image "{image}"'

    def _pull_backoff(self, pod: dict[str, Any]) -> bool:
        """Hold ``pod`` Pending in ImagePullBackOff while any of its images cannot be had; True when it is."""
        spec = pod["spec"]
        problems = {c["name"]: self.image_problem(c) for c in spec.get("initContainers", []) + spec["containers"]}
        if not any(problems.values()):
            return False

        def statuses(containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
            out = []
            for c in containers:
                why = problems[c["name"]] or ("PodInitializing", "")
                waiting = {"reason": why[0], **({"message": why[1]} if why[1] else {})}
                out.append({"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": False,
                            "restartCount": 0, "started": False, "state": {"waiting": waiting}})
            return out

        status = {"phase": "Pending", "podIP": (pod.get("status") or {}).get("podIP") or self._next_ip(),
                  "conditions": [{"type": "PodScheduled", "status": "True"},
                                 {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
                                 {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
                  "containerStatuses": statuses(spec["containers"]),
                  **({"initContainerStatuses": statuses(spec["initContainers"])} if spec.get("initContainers") else {})}
        old = pod.get("status") or {}
        if {k: v for k, v in old.items() if k != "startTime"} != status:
            self.api._store(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"],
                            {"status": {**status, "startTime": old.get("startTime") or _now()}}, subresource="status")
        return True

    def add_node(self, name: str, gpus: int, labels: dict[str, str] | None = None) -> None:
        cap = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU: str(gpus)}
        self.api.seed(NODES, None, {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                                         **(labels or {})}},
                                   "status": {"capacity": cap, "allocatable": dict(cap),
                                              "conditions": [{"type": "Ready", "status": "True"}]}})

    async def __aenter__(self) -> "Kubelet":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            self.step()
            await asyncio.sleep(self.tick)

    # -- one simulation step (synchronous: no other coroutine interleaves)
    def step(self) -> None:
        pods = self.api.select(PODS)
        nodes = self.api.select(NODES)
        used: dict[str, int] = {}
        for p in pods:
            node = p["spec"].get("nodeName")
            if node and p.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                used[node] = used.get(node, 0) + _pod_gpus(p)
        for p in pods:
            if p["metadata"].get("deletionTimestamp"):
                self._finish_termination(p)
                continue
            if p["spec"].get("nodeName") in self.down_nodes:
                continue
            if not p["spec"].get("nodeName"):
                self._schedule(p, nodes, used)
            elif not self.runs_pod(p):
                continue  # the ReplicaSet's part: _deployment_pods
            elif p.get("status", {}).get("phase", "Pending") == "Pending":
                if not self._pull_backoff(p):
                    self._start(p)
            elif p["status"].get("phase") == "Running":
                want = self.auto_ready and p["metadata"]["name"] not in self.not_ready
                if self._is_ready(p) != want:
                    self._set_ready(p, want)
        self.step_deployments()

    def runs_pod(self, pod: Mapping[str, Any]) -> bool:
        """Whether :meth:`step` starts ``pod`` and keeps its readiness (Deployments' pods: :meth:`step_deployments`)."""
        return not _owned_by_deployment(pod)

    def step_deployments(self) -> None:
        """The Deployment controller's part of a step: status (and, with ``router_ip``, pods) per Deployment."""
        for d in self.api.select(DEPLOYMENTS):
            n = d.get("spec", {}).get("replicas", 1)
            if self.router_ip:
                self._deployment_pods(d, n)
            # its pods run only with their images at hand; else none is ready or available
            template = d["spec"]["template"]["spec"]
            ok = not any(self.image_problem(c) for c in template.get("initContainers", []) + template["containers"])
            ready = n if ok else 0
            st = {"observedGeneration": d["metadata"]["generation"], "replicas": n, "readyReplicas": ready,
                  "availableReplicas": ready, "updatedReplicas": n,
                  **({} if ok else {"unavailableReplicas": n})}
            if d.get("status") != st:
                self.api._store(DEPLOYMENTS, d["metadata"]["namespace"], d["metadata"]["name"], {"status": st},
                                subresource="status")

    def _finish_termination(self, pod: dict[str, Any]) -> None:
        """Graceful deletion: once the container exited (SIGTERM) the kubelet confirms and the pod is gone.
        A kubelet on a lost node never confirms: the pod stays Terminating until force-deleted."""
        meta = pod["metadata"]
        node = pod["spec"].get("nodeName")
        if node in self.down_nodes or meta.get("finalizers"):
            return
        exit_at = self.api._exit_at.get((meta["namespace"], meta["name"]), 0.0)
        if time.monotonic() >= exit_at:
            self.api._exit_at.pop((meta["namespace"], meta["name"]), None)
            self.api._remove(PODS, meta["namespace"], meta["name"])

    def node_down(self, name: str) -> None:
        """The node stops reporting (kubelet gone): Ready=Unknown, its pods are frozen as they are."""
        self.down_nodes.add(name)
        node = self.api.read(NODES, None, name)
        status = copy.deepcopy(node["status"])
        status["conditions"] = [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                                 "message": "Kubelet stopped posting node status."}]
        self.api._store(NODES, None, name, {"status": status}, subresource="status")

    def _deployment_pods(self, d: dict[str, Any], n: int) -> None:
        """The ReplicaSet's part, minimal: ``n`` running, ready pods from the template, at ``router_ip``."""
        meta = d["metadata"]
        labels = d["spec"]["template"]["metadata"].get("labels", {})
        sel = ",".join(f"{k}={v}" for k, v in labels.items())
        have = self.api.select(PODS, meta["namespace"], sel)
        for p in have:  # waiting for an image: runs once it is loaded
            if p["status"].get("phase") == "Pending" and not self._pull_backoff(p):
                status = {"phase": "Running", "podIP": self.router_ip, "startTime": _now(),
                          "conditions": [{"type": "Ready", "status": "True"}]}
                self.api._store(PODS, meta["namespace"], p["metadata"]["name"], {"status": status},
                                subresource="status")
        for i in range(len(have), n):
            pod = {"metadata": {"name": f"{meta['name']}-{secrets.token_hex(3)}", "labels": dict(labels),
                                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                     "name": meta["name"], "uid": meta["uid"]}]},
                   "spec": {**copy.deepcopy(d["spec"]["template"]["spec"]), "nodeName": "router-node"}}
            created = self.api._create(PODS, meta["namespace"], pod, manager="kube-controller-manager")
            if self._pull_backoff(created):
                continue
            status = {"phase": "Running", "podIP": self.router_ip, "startTime": _now(),
                      "conditions": [{"type": "Ready", "status": "True"}]}
            self.api._store(PODS, meta["namespace"], created["metadata"]["name"], {"status": status},
                            subresource="status")

    def _schedule(self, pod: dict[str, Any], nodes: list[dict[str, Any]], used: dict[str, int]) -> None:
        need = _pod_gpus(pod)
        selector = pod["spec"].get("nodeSelector", {}) or {}
        fits = []
        for n in nodes:
            labels = n["metadata"].get("labels", {})
            if any(labels.get(k) != v for k, v in selector.items()) or n["metadata"]["name"] in self.down_nodes:
                continue
            free = int(n["status"]["allocatable"].get(GPU, 0)) - used.get(n["metadata"]["name"], 0)
            if free >= need:
                fits.append(n["metadata"]["name"])
        status = copy.deepcopy(pod.get("status", {}))
        if fits:
            node = fits[0]
            used[node] = used.get(node, 0) + need
            pod = copy.deepcopy(pod)
            pod["spec"]["nodeName"] = node
            meta = pod["metadata"]
            self.api._store(PODS, meta["namespace"], meta["name"], pod)
            status.update(phase="Pending", conditions=[{"type": "PodScheduled", "status": "True"}])
            self.api._store(PODS, meta["namespace"], meta["name"], {"status": status}, subresource="status")
            return
        short = sum(1 for n in nodes if not any((n["metadata"].get("labels", {}) or {}).get(k) != v
                                                for k, v in selector.items()))
        msg = (f"0/{len(nodes)} nodes are available: {short} Insufficient {GPU}, "
               f"{len(nodes) - short} node(s) didn't match Pod's node affinity/selector.")
        cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}
        if status.get("conditions") != [cond]:
            status.update(phase="Pending", conditions=[cond])
            self.api._store(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": status},
                            subresource="status")

    def _start(self, pod: dict[str, Any]) -> None:
        ready = self.auto_ready and pod["metadata"]["name"] not in self.not_ready
        status = {
            "phase": "Running", "podIP": self._next_ip(),
            "startTime": _now(),
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": c["name"], "restartCount": 0, "ready": ready,
                                   "state": {"running": {"startedAt": _now()}}}
                                  for c in pod["spec"].get("containers", [])],
        }
        self.api._store(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": status},
                        subresource="status")

    def _next_ip(self) -> str:
        n = next(self._ips)
        return f"10.0.{n // 250}.{n % 250 + 1}"

    @staticmethod
    def _is_ready(pod: dict[str, Any]) -> bool:
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in pod.get("status", {}).get("conditions", []))

    def _set_ready(self, pod: dict[str, Any], ready: bool) -> None:
        status = copy.deepcopy(pod["status"])
        status["conditions"] = [c for c in status.get("conditions", []) if c.get("type") != "Ready"] + [
            {"type": "Ready", "status": "True" if ready else "False"}]
        for cs in status.get("containerStatuses", []):
            cs["ready"] = ready
        self.api._store(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": status},
                        subresource="status")

    # -- test controls
    def _pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self.api.read(PODS, namespace, name)
        assert pod is not None, f"no pod {namespace}/{name}"
        return pod

    def set_ready(self, namespace: str, name: str, ready: bool = True) -> None:
        (self.not_ready.discard if ready else self.not_ready.add)(name)
        pod = self._pod(namespace, name)
        if pod.get("status", {}).get("phase") == "Running":
            self._set_ready(pod, ready and self.auto_ready)

    def restart_container(self, namespace: str, name: str, *, oom: bool = False) -> None:
        """The container died and the kubelet restarted it: restartCount rises, lastState says why."""
        pod = self._pod(namespace, name)
        status = copy.deepcopy(pod["status"])
        for cs in status["containerStatuses"]:
            cs["restartCount"] += 1
            cs["lastState"] = {"terminated": {"reason": "OOMKilled" if oom else "Error",
                                              "exitCode": 137 if oom else 1, "finishedAt": _now()}}
            cs["state"] = {"running": {"startedAt": _now()}}
        self.api._store(PODS, namespace, name, {"status": status}, subresource="status")

    def evict(self, namespace: str, name: str) -> None:
        pod = self._pod(namespace, name)
        status = copy.deepcopy(pod["status"])
        status.update(phase="Failed", reason="Evicted", message="The node was low on resource: memory.")
        status["conditions"] = [c for c in status.get("conditions", []) if c.get("type") != "Ready"] + [
            {"type": "Ready", "status": "False"}]
        self.api._store(PODS, namespace, name, {"status": status}, subresource="status")
