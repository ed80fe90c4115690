"""The test cluster's process kubelet: every pod a real local process, started from its rendered container.

What a node's kubelet and container runtime do, on one host and loopback:

* **network**: each pod gets its own loopback address (``127.0.NET.N``) as its pod IP; a container's wildcard
  bind (``0.0.0.0`` in its args or env) is its own address, as in the pod's network namespace. A Service is
  resolved to a Ready pod's IP and target port (:meth:`ProcessKubelet.service_address`, what kube-proxy and
  cluster DNS give a client);
* **image**: only loaded images run (:meth:`Kubelet.load`, ``kind load``), each with its ENTRYPOINT/CMD (the
  Dockerfiles' ``images=`` table); a container's ``command`` replaces the ENTRYPOINT, ``args`` the CMD. The
  program is looked up on the image's PATH, here the project's virtual environment (``pdrt``, ``python``);
* **volumes**: Secret and ConfigMap volumes are written once at start under the pod's directory, emptyDirs are
  empty directories; every argument or env value under a ``mountPath`` is rewritten to that directory;
* **NetworkPolicy**: every pod process carries the test cluster's CNI (``cni/sitecustomize.py``): each TCP
  connect into the pod network asks :meth:`_verdict` (``netpol.connection_check`` over the stored policies,
  the pod's IP as source) and a denied one is dropped as an enforcing CNI drops it (the client's connect
  timeout fires); ``connections`` records every verdict. The kubelet's own probes are node traffic (always
  allowed); the API server's pods/proxy is not checked;
* **DNS**: a Service name with its port in an argument or env value is resolved when the container starts;
* **env**: ``value``, ``valueFrom`` fieldRef (metadata.name/namespace, status.podIP, spec.nodeName,
  spec.serviceAccountName), secretKeyRef and configMapKeyRef; the service account's credentials are a
  kubeconfig of its own (``credentials(namespace, name)``), so the stored RBAC is what the process runs under;
* **probes**: readiness is the container's ``readinessProbe`` (httpGet on the pod IP; none: ready once started);
  a container that exits is restarted (``restartPolicy: Always``, ``restartCount`` + 1) or ends the pod
  (``Never``/``OnFailure``: Succeeded or Failed);
* **deletion**: SIGTERM, then SIGKILL after the grace period; the pod is removed once the process exited. The
  preStop hook is not run (it only delays SIGTERM);
* **Deployments** (the ReplicaSet's part): pods from the template, labelled with its hash; ``Recreate`` deletes
  the old pods before creating new ones, ``RollingUpdate`` deletes them once the new ones are Ready; status from
  the pods as they are. ``kubectl logs`` reads the container's output (``api.pod_log``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import ctypes
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

import aiohttp.web
import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests" / "operator") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the emulator's modules

from pdop_k8s_emulator import PODS, PDEmulator, R, _now  # noqa: E402  (before emu_kubelet: it imports that)
from emu_kubelet import DEPLOYMENTS, Kubelet, image_ref  # noqa: E402
import netpol  # noqa: E402

SECRETS = R("", "v1", "secrets")
CONFIGMAPS = R("", "v1", "configmaps")
SERVICES = R("", "v1", "services")
HASH_LABEL = "pod-template-hash"
VENV_BIN = Path(sys.executable).parent  # the "image's" PATH: the project's venv has pdrt, python, kubectl-pd
PROBE_INTERVAL_S = 0.5
VOLUME_SYNC_S = 1.0  # a real kubelet's sync period plus cache TTL is up to about a minute; here one second
SERVICE_DNS = re.compile(r"(?P<name>[a-z0-9-]+)\.(?P<ns>[a-z0-9-]+)\.svc(?:\.cluster\.local)?:(?P<port>\d+)")
ROOT = Path(__file__).resolve().parents[2]
# the two images as images/*/Dockerfile build them: reference -> (ENTRYPOINT, CMD)
DEV_IMAGES = {"pdstack-operator:dev": (["python", "-m", "pdoperator"], ["--standalone"]),
              "pdstack-runtime:dev": ([], ["pdrt", "up", "--host", "0.0.0.0"])}
CNI_DIR = Path(__file__).resolve().parent / "cni"  # its sitecustomize.py checks each connect (module docstring)
IMAGE_PYTHONPATH = f"{ROOT / 'runtime'}:{ROOT / 'operator'}"  # what both images install: this checkout's packages


def _die_with_parent() -> None:
    """In the child: SIGKILL when the kubelet's thread goes (a killed test run leaves no pod process behind)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def template_hash(template: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions", []))


class ProcessKubelet(Kubelet):
    """Scheduler, kubelet and ReplicaSet controller whose containers are local processes (module docstring).

    ``images``: loaded image -> its (ENTRYPOINT, CMD); ``credentials(namespace, service_account)``: the path of a
    kubeconfig for that account; ``net``: the loopback /24 the pod IPs come from; ``workdir``: pods' files and logs.
    """

    def __init__(self, api: PDEmulator, *, images: Mapping[str, tuple[list[str], list[str]]], net: int,
                 workdir: Path, credentials: Callable[[str, str], Path], extra_env: Mapping[str, str] | None = None,
                 network_policy: bool = True):
        super().__init__(api, images=images, tick=0.1)
        self.entrypoints = {k: v for k, v in images.items()}
        self.net, self.workdir, self.credentials = net, Path(workdir), credentials
        self.extra_env = dict(extra_env or {})
        self._hosts = itertools.count(10)
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.sigterm_at: dict[tuple[str, str], float] = {}
        self._probes: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._projected: dict[tuple[tuple[str, str], Path], tuple[Any, str]] = {}  # (pod, dir) -> (kind, name)
        self._synced_at = 0.0
        self.errors = 0  # ticks that raised (see kubelet.log)
        # the CNI (cni/sitecustomize.py in every pod process): connections checked against stored NetworkPolicies
        self.network_policy = network_policy
        self.check = netpol.connection_check(api)
        self.connections: list[tuple[str, str, int, bool, str]] = []  # (src, dst, port, allowed, reason), in order
        self.cni_url = ""
        self._cni: aiohttp.web.AppRunner | None = None
        api.pod_log = self.read_log

    # -- network
    def _next_ip(self) -> str:
        return f"127.0.{self.net}.{next(self._hosts)}"

    def service_address(self, namespace: str, name: str, port: int | str) -> tuple[str, int] | None:
        """(pod IP, target port) of a Ready pod behind Service ``name``'s ``port`` (number or name), else None."""
        svc = self.api.read(SERVICES, namespace, name)
        if svc is None:
            return None
        sp = next((p for p in svc["spec"].get("ports", []) if port in (p.get("port"), p.get("name"))), None)
        if sp is None:
            return None
        sel = ",".join(f"{k}={v}" for k, v in (svc["spec"].get("selector") or {}).items())
        for pod in self.api.select(PODS, namespace, sel):
            if pod["metadata"].get("deletionTimestamp") or not _ready(pod):
                continue
            target = sp.get("targetPort", sp["port"])
            if isinstance(target, str):
                target = next((p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []
                               if p.get("name") == target), None)
            if target:
                return pod["status"]["podIP"], int(target)
        return None

    # -- pods
    def runs_pod(self, pod: Mapping[str, Any]) -> bool:
        return True  # Deployments' pods are processes too (created by step_deployments)

    def _pod_dir(self, namespace: str, name: str) -> Path:
        return self.workdir / "pods" / namespace / name

    def read_log(self, namespace: str, name: str) -> str:
        log = self._pod_dir(namespace, name) / "container.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def _volumes(self, pod: dict[str, Any], root: Path) -> dict[str, Path]:
        """Materialise the pod's volumes under ``root``; returns mountPath -> host directory (or file)."""
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        dirs: dict[str, Path] = {}
        for v in pod["spec"].get("volumes") or []:
            d = root / "volumes" / v["name"]
            d.mkdir(parents=True, exist_ok=True)
            if "secret" in v:
                self._projected[(key, d)] = (SECRETS, v["secret"]["secretName"])
            elif "configMap" in v:
                self._projected[(key, d)] = (CONFIGMAPS, v["configMap"]["name"])
            dirs[v["name"]] = d
        self._sync_volumes(key)
        mounts: dict[str, Path] = {}
        for m in pod["spec"]["containers"][0].get("volumeMounts") or []:
            if m["name"] in dirs:
                mounts[m["mountPath"].rstrip("/")] = dirs[m["name"]] / m.get("subPath", "")
        return mounts

    def _sync_volumes(self, only: tuple[str, str] | None = None) -> None:
        """Secret and ConfigMap volumes follow their objects, as the kubelet's periodic sync does (a running
        router hot-reloads the topology ConfigMap this way); each key is replaced atomically."""
        for (key, d), (res, name) in list(self._projected.items()):
            if only is not None and key != only:
                continue
            if key not in self.procs and only is None:
                del self._projected[(key, d)]
                continue
            obj = self.api.read(res, key[0], name) or {}
            data = obj.get("data") or {}
            for k, value in data.items():
                blob = base64.b64decode(value) if res == SECRETS else value.encode()
                path = d / k
                if not path.exists() or path.read_bytes() != blob:
                    tmp = d / f".{k}.tmp"
                    tmp.write_bytes(blob)
                    os.replace(tmp, path)

    def _rewrite(self, value: str, mounts: Mapping[str, Path], ip: str) -> str:
        """A path under a mount to its host directory, the wildcard address to the pod's, and a Service's DNS
        name with its port (``NAME.NS.svc[.cluster.local]:PORT``) to a Ready pod's address behind it."""
        for mount in sorted(mounts, key=len, reverse=True):
            if value == mount or value.startswith(mount + "/"):
                value = str(mounts[mount]) + value[len(mount):]
                break

        def resolve(m: re.Match[str]) -> str:
            addr = self.service_address(m["ns"], m["name"], int(m["port"]))
            return f"{addr[0]}:{addr[1]}" if addr else m[0]
        return SERVICE_DNS.sub(resolve, value.replace("0.0.0.0", ip))

    def _env(self, pod: dict[str, Any], ctr: Mapping[str, Any], ip: str) -> dict[str, str]:
        ns, meta = pod["metadata"]["namespace"], pod["metadata"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": ns, "status.podIP": ip,
                  "spec.nodeName": pod["spec"].get("nodeName", ""),
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default")}
        out: dict[str, str] = {}
        for e in ctr.get("env") or []:
            if "value" in e:
                out[e["name"]] = str(e["value"])
                continue
            src = e.get("valueFrom") or {}
            if "fieldRef" in src:
                out[e["name"]] = fields.get(src["fieldRef"]["fieldPath"], "")
            elif "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                data = (self.api.read(SECRETS, ns, ref["name"]) or {}).get("data") or {}
                if ref["key"] in data:
                    out[e["name"]] = base64.b64decode(data[ref["key"]]).decode()
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                data = (self.api.read(CONFIGMAPS, ns, ref["name"]) or {}).get("data") or {}
                if ref["key"] in data:
                    out[e["name"]] = data[ref["key"]]
        return out

    def _argv(self, ctr: Mapping[str, Any]) -> list[str]:
        entrypoint, cmd = self.entrypoints.get(ctr["image"]) or next(
            (v for k, v in self.entrypoints.items() if image_ref(k) == image_ref(ctr["image"])), ([], []))
        argv = list(ctr["command"]) + list(ctr.get("args") or []) if ctr.get("command") else \
            list(entrypoint) + list(ctr["args"] if "args" in ctr else cmd)
        assert argv, f"container {ctr['name']}: no command and no image entrypoint"
        program = shutil.which(argv[0], path=f"{VENV_BIN}:/usr/bin:/bin")
        assert program, f"container {ctr['name']}: {argv[0]!r} is not on the image's PATH ({VENV_BIN})"
        return [program, *argv[1:]]

    def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        self.not_ready.add(meta["name"])  # Ready once its readiness probe answers
        super()._start(pod)
        self._launch(self.api.read(PODS, *key))

    def _launch(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        ip = pod["status"]["podIP"]
        root = self._pod_dir(*key)
        root.mkdir(parents=True, exist_ok=True)
        ctr = pod["spec"]["containers"][0]
        mounts = self._volumes(pod, root)
        argv = [self._rewrite(a, mounts, ip) for a in self._argv(ctr)]
        env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1", "TMPDIR": str(mounts.get("/tmp", root)), "PYTHONPATH": IMAGE_PYTHONPATH,
               **self.extra_env}
        if self.cni_url:
            env.update(PYTHONPATH=f"{CNI_DIR}:{IMAGE_PYTHONPATH}", PDSTACK_CNI_URL=self.cni_url,
                       PDSTACK_CNI_POD_IP=ip, PDSTACK_CNI_POD_CIDR=f"127.0.{self.net}.0/24")
        if pod["spec"].get("automountServiceAccountToken", True):
            env["KUBECONFIG"] = str(self.credentials(meta["namespace"],
                                                     pod["spec"].get("serviceAccountName") or "default"))
        env.update({k: self._rewrite(v, mounts, ip) for k, v in self._env(pod, ctr, ip).items()})
        with open(root / "container.log", "ab") as log:
            log.write(f"--- {_now()} {' '.join(argv)}\n".encode())
            log.flush()
            self.procs[key] = subprocess.Popen(argv, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True, preexec_fn=_die_with_parent)
        old = self._probes.pop(key, None)
        if old:
            old.cancel()
        self._probes[key] = asyncio.get_running_loop().create_task(self._probe(pod, ip))

    async def _probe(self, pod: dict[str, Any], ip: str) -> None:
        """The readiness probe: Ready while httpGet answers 2xx/3xx (no probe: Ready once started)."""
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        ctr = pod["spec"]["containers"][0]
        get = (ctr.get("readinessProbe") or {}).get("httpGet")
        if get is None:
            self.not_ready.discard(meta["name"])
            return
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in ctr.get("ports") or [] if p.get("name") == port)
        url = f"http://{ip}:{port}{get.get('path', '/')}"
        async with httpx.AsyncClient() as http:
            while self.procs[key].poll() is None and key not in self.sigterm_at:
                try:
                    ok = (await http.get(url, timeout=2)).status_code < 400
                except httpx.HTTPError:
                    ok = False
                (self.not_ready.discard if ok else self.not_ready.add)(meta["name"])
                await asyncio.sleep(PROBE_INTERVAL_S)

    def step(self) -> None:
        """One tick; an error is written to ``WORKDIR/kubelet.log`` and the next tick tries again (a kubelet
        keeps running: a dead loop would leave every pod as it is, silently)."""
        try:
            self._reap()
            if time.monotonic() - self._synced_at > VOLUME_SYNC_S:
                self._synced_at = time.monotonic()
                self._sync_volumes()
            super().step()
        except Exception:  # noqa: BLE001 - logged, retried next tick
            self.errors += 1
            with open(self.workdir / "kubelet.log", "a") as fh:
                fh.write(f"--- {_now()}\n{traceback.format_exc()}")

    def _reap(self) -> None:
        """Exited containers: restarted under ``restartPolicy: Always``, else the pod Succeeded or Failed."""
        for key, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is None or key in self.sigterm_at:
                continue
            pod = self.api.read(PODS, *key)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                continue
            status = copy.deepcopy(pod["status"])
            cs = status["containerStatuses"][0]
            terminated = {"exitCode": rc, "reason": "Completed" if rc == 0 else "Error", "finishedAt": _now()}
            policy = pod["spec"].get("restartPolicy", "Always")
            if policy == "Always" or (policy == "OnFailure" and rc != 0):
                self.not_ready.add(key[1])
                cs.update(restartCount=cs["restartCount"] + 1, lastState={"terminated": terminated}, ready=False,
                          state={"running": {"startedAt": _now()}})
                self.api._store(PODS, *key, {"status": status}, subresource="status")
                self._launch(self.api.read(PODS, *key))
            else:
                del self.procs[key]
                cs.update(state={"terminated": terminated}, ready=False)
                status["phase"] = "Succeeded" if rc == 0 else "Failed"
                status["conditions"] = [c for c in status["conditions"] if c["type"] != "Ready"] + [
                    {"type": "Ready", "status": "False", "reason": "PodCompleted"}]
                self.api._store(PODS, *key, {"status": status}, subresource="status")

    def _finish_termination(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        proc = self.procs.get(key)
        if proc is None or meta.get("finalizers"):
            return super()._finish_termination(pod)
        if key not in self.sigterm_at:
            self.sigterm_at[key] = time.monotonic()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        grace = meta.get("deletionGracePeriodSeconds", pod["spec"].get("terminationGracePeriodSeconds", 30))
        if proc.poll() is None and time.monotonic() - self.sigterm_at[key] > grace:
            proc.kill()
        if proc.poll() is not None:
            self.procs.pop(key)
            self.sigterm_at.pop(key)
            probe = self._probes.pop(key, None)
            if probe:
                probe.cancel()
            self.not_ready.discard(meta["name"])
            self.api._remove(PODS, *key)

    # -- Deployments: the ReplicaSet's part
    def step_deployments(self) -> None:
        for d in self.api.select(DEPLOYMENTS):
            meta, spec = d["metadata"], d["spec"]
            ns = meta["namespace"]
            want = spec.get("replicas", 1)
            h = template_hash(spec["template"])
            mine = [p for p in self.api.select(PODS, ns) if any(
                r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences") or [])]
            live = [p for p in mine if not p["metadata"].get("deletionTimestamp")]
            new = [p for p in live if p["metadata"]["labels"].get(HASH_LABEL) == h]
            old = [p for p in live if p not in new]
            recreate = (spec.get("strategy") or {}).get("type") == "Recreate"
            if old and (recreate or (len(new) >= want and all(_ready(p) for p in new))):
                for p in old:
                    self.api._delete(PODS, ns, p["metadata"]["name"])
            for p in new[want:]:
                self.api._delete(PODS, ns, p["metadata"]["name"])
            if not (recreate and (old or len(mine) > len(live))):
                for _ in range(len(new), want):
                    self._replica(d, h)
            ready = sum(1 for p in new[:want] if _ready(p))
            done = ready >= want and not old and len(live) == want
            st = {"observedGeneration": meta["generation"], "replicas": len(live),
                  "updatedReplicas": min(len(new), want), "readyReplicas": ready, "availableReplicas": ready,
                  **({"unavailableReplicas": want - ready} if ready < want else {}),
                  # what `helm --wait` (kstatus) and `kubectl rollout status` read
                  "conditions": [{"type": "Available", "status": "True" if ready >= want else "False"},
                                 {"type": "Progressing", "status": "True",
                                  "reason": "NewReplicaSetAvailable" if done else "ReplicaSetUpdated"}]}
            if d.get("status") != st:
                self.api._store(DEPLOYMENTS, ns, meta["name"], {"status": st}, subresource="status")

    def _replica(self, d: dict[str, Any], h: str) -> None:
        meta, template = d["metadata"], copy.deepcopy(d["spec"]["template"])
        labels = {**(template["metadata"].get("labels") or {}), HASH_LABEL: h}
        pod = {"metadata": {"name": f"{meta['name']}-{h[:6]}-{secrets.token_hex(3)[:5]}", "labels": labels,
                            "annotations": template["metadata"].get("annotations") or {},
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                                 "uid": meta["uid"], "controller": True,
                                                 "blockOwnerDeletion": True}]},
               "spec": template["spec"]}
        self.api._create(PODS, meta["namespace"], pod, manager="kube-controller-manager")

    async def __aenter__(self) -> "ProcessKubelet":
        if self.network_policy:
            app = aiohttp.web.Application()
            app.router.add_get("/v1/verdict", self._verdict)
            self._cni = aiohttp.web.AppRunner(app, access_log=None)
            await self._cni.setup()
            site = aiohttp.web.TCPSite(self._cni, "127.0.0.1", 0)
            await site.start()
            self.cni_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        await super().__aenter__()
        return self

    async def _verdict(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        """The CNI's question from a pod process: may ``src`` open ``dst:port`` (TCP)? Recorded in ``connections``."""
        src, dst, port = request.query["src"], request.query["dst"], int(request.query["port"])
        verdict = self.check(src, dst, port)
        self.connections.append((src, dst, port, verdict.allowed, verdict.reason))
        return aiohttp.web.json_response({"allowed": verdict.allowed, "reason": verdict.reason})

    async def __aexit__(self, *exc: Any) -> None:
        await super().__aexit__(*exc)
        if self._cni is not None:
            await self._cni.cleanup()
        for probe in self._probes.values():
            probe.cancel()
        self.stop_all()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(10)
