"""A NetworkPolicy evaluator (pure): is one connection allowed by the stored ``networking.k8s.io/v1`` policies?

It follows the NetworkPolicy API's semantics as the Kubernetes documentation states them
(concepts/services-networking/network-policies):

* a pod is isolated for ingress (egress) once any policy in its namespace selects it (``spec.podSelector``;
  ``{}`` selects every pod) with ``Ingress`` (``Egress``) among its ``policyTypes``; absent ``policyTypes``
  means ``Ingress``, plus ``Egress`` when the policy has ``egress`` rules;
* policies are additive: an isolated pod accepts what the union of the selecting policies' rules allows, and
  nothing else (default deny); a non-isolated pod accepts everything;
* a rule allows traffic that matches both its peers (``from`` / ``to``; absent or empty = every peer) and its
  ``ports`` (absent or empty = every port); a peer is a ``podSelector`` (pods of the policy's namespace), a
  ``namespaceSelector`` (every pod of the matching namespaces), both in one element (those pods in those
  namespaces), or an ``ipBlock`` (``cidr`` minus each ``except``);
* a port is ``protocol`` (default TCP) and ``port``: a number, a range up to ``endPort``, or a container port's
  name, resolved on the destination pod (the selected pod for ingress, the peer pod for egress);
* a connection between pods needs the source's egress and the destination's ingress both to allow it;
* exceptions: a pod never blocks itself, and traffic from its own node (kubelet probes) is always allowed.

``ipBlock`` is matched against every source/destination IP, pod IPs included (what Calico, Cilium and the
reference implementations do; the docs leave IP rewriting by Services and load balancers undefined).

The operator, Prometheus and external clients are ``Endpoint``s: a pod (labels, namespace, IP, its named
ports) or a bare IP outside the cluster. :func:`connection_allowed` decides; :func:`why` says which rule did.
:func:`from_store` builds the inputs from what an API emulator stores (see its docstring for the wiring).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace (1.22+)


@dataclass(frozen=True)
class Endpoint:
    """One end of a connection: a pod (``namespace`` set) or a cluster-external address (``namespace`` None)."""

    ip: str
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (name, protocol) -> containerPort
    node: str | None = None
    name: str = ""

    @property
    def is_pod(self) -> bool:
        return self.namespace is not None


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str

    def __bool__(self) -> bool:
        return self.allowed


# ---------------------------------------------------------------- selectors
def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector: ``matchLabels`` and every ``matchExpressions`` entry (In, NotIn, Exists,
    DoesNotExist); an empty selector matches everything. (A *null* selector is the caller's business: in a
    peer it means "this part is not given".)"""
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"label selector operator {op!r}; accepted: In, NotIn, Exists, DoesNotExist")
    return True


def policy_types(policy: Mapping[str, Any]) -> tuple[str, ...]:
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return tuple(spec["policyTypes"])
    return ("Ingress", "Egress") if spec.get("egress") else ("Ingress",)


def ip_in_block(ip: str, block: Mapping[str, Any]) -> bool:
    addr = ipaddress.ip_address(ip)
    net = ipaddress.ip_network(block["cidr"], strict=False)
    if addr.version != net.version or addr not in net:
        return False
    return not any(addr in ipaddress.ip_network(x, strict=False) for x in block.get("except") or []
                   if ipaddress.ip_network(x, strict=False).version == addr.version)


# ---------------------------------------------------------------- the evaluator
@dataclass
class Cluster:
    """What the evaluator reads: policies (as stored), namespace labels by name."""

    policies: list[Mapping[str, Any]]
    namespaces: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def ns_labels(self, namespace: str) -> dict[str, str]:
        return {**(self.namespaces.get(namespace) or {}), NAMESPACE_NAME_LABEL: namespace}

    def selecting(self, pod: Endpoint, direction: str) -> list[Mapping[str, Any]]:
        """Policies that isolate ``pod`` for ``direction`` (Ingress | Egress)."""
        return [p for p in self.policies
                if (p.get("metadata") or {}).get("namespace", "default") == pod.namespace
                and direction in policy_types(p)
                and selector_matches((p.get("spec") or {}).get("podSelector"), pod.labels)]

    def peer_matches(self, peer: Mapping[str, Any], policy_ns: str, other: Endpoint) -> bool:
        if "ipBlock" in peer and peer["ipBlock"] is not None:
            return ip_in_block(other.ip, peer["ipBlock"])
        pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
        if pod_sel is None and ns_sel is None:
            raise ValueError(f"NetworkPolicyPeer {dict(peer)!r} sets nothing; accepted: podSelector, "
                             "namespaceSelector, or ipBlock")
        if not other.is_pod:
            return False  # selectors select pods; a cluster-external address matches only an ipBlock
        if ns_sel is None:  # podSelector alone: pods of the policy's own namespace
            in_ns = other.namespace == policy_ns
        else:
            in_ns = selector_matches(ns_sel, self.ns_labels(other.namespace or ""))
        return in_ns and (pod_sel is None or selector_matches(pod_sel, other.labels))

    @staticmethod
    def port_matches(rule_port: Mapping[str, Any], port: int, protocol: str, dst: Endpoint) -> bool:
        if rule_port.get("protocol", "TCP") != protocol:
            return False
        want = rule_port.get("port")
        if want is None:
            return True  # every port of that protocol
        if isinstance(want, str) and not want.isdigit():
            if rule_port.get("endPort") is not None:
                raise ValueError(f"endPort with a named port {want!r}; accepted: endPort only with a numeric port")
            return dst.ports.get((want, protocol)) == port  # named: resolved on the destination pod
        lo = int(want)
        hi = int(rule_port.get("endPort", lo))
        return lo <= port <= hi

    def rules_allow(self, policies: Iterable[Mapping[str, Any]], key: str, peer_key: str, other: Endpoint,
                    port: int, protocol: str, dst: Endpoint) -> str | None:
        """The first rule (``ns/policy key[i]``) of ``policies`` that admits ``other`` on ``port``, else None."""
        for p in policies:
            meta = p.get("metadata") or {}
            ns = meta.get("namespace", "default")
            for i, rule in enumerate((p.get("spec") or {}).get(key) or []):
                peers = rule.get(peer_key) or []
                ports = rule.get("ports") or []
                if peers and not any(self.peer_matches(x, ns, other) for x in peers):
                    continue
                if ports and not any(self.port_matches(x, port, protocol, dst) for x in ports):
                    continue
                return f"{ns}/{meta.get('name')} {key}[{i}]"
        return None


def connection_allowed(cluster: Cluster, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> Verdict:
    """May ``src`` open a connection to ``dst``:``port``/``protocol``? Egress at the source pod and ingress at
    the destination pod must both allow it (an end outside the cluster has no policy of its own)."""
    if src.is_pod and dst.is_pod and src.namespace == dst.namespace and src.name and src.name == dst.name:
        return Verdict(True, "a pod never blocks itself")
    if dst.is_pod and not src.is_pod and src.node is not None and src.node == dst.node:
        return Verdict(True, f"from the pod's own node {src.node}")
    reasons = []
    if src.is_pod:
        egress = cluster.selecting(src, "Egress")
        if egress:
            rule = cluster.rules_allow(egress, "egress", "to", dst, port, protocol, dst)
            if rule is None:
                names = ", ".join(f"{p['metadata'].get('namespace', 'default')}/{p['metadata']['name']}"
                                  for p in egress)
                return Verdict(False, f"egress from {src.namespace}/{src.name or src.ip} denied: isolated by "
                                      f"{names}, no egress rule admits {dst.ip}:{port}/{protocol}")
            reasons.append(f"egress by {rule}")
        else:
            reasons.append("source not isolated for egress")
    if dst.is_pod:
        ingress = cluster.selecting(dst, "Ingress")
        if ingress:
            rule = cluster.rules_allow(ingress, "ingress", "from", src, port, protocol, dst)
            if rule is None:
                names = ", ".join(f"{p['metadata'].get('namespace', 'default')}/{p['metadata']['name']}"
                                  for p in ingress)
                return Verdict(False, f"ingress to {dst.namespace}/{dst.name or dst.ip}:{port}/{protocol} denied: "
                                      f"isolated by {names}, no ingress rule admits {src.namespace or 'external'}/"
                                      f"{src.name or src.ip}")
            reasons.append(f"ingress by {rule}")
        else:
            reasons.append("destination not isolated for ingress")
    return Verdict(True, "; ".join(reasons))


def why(cluster: Cluster, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> str:
    return connection_allowed(cluster, src, dst, port, protocol).reason


# ---------------------------------------------------------------- from stored objects
def pod_endpoint(pod: Mapping[str, Any]) -> Endpoint:
    """An Endpoint from a stored Pod: its labels, namespace, IP (``status.podIP``), node and named ports."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    ports = {(p["name"], p.get("protocol", "TCP")): int(p["containerPort"])
             for c in spec.get("containers") or [] for p in c.get("ports") or [] if p.get("name")}
    return Endpoint(ip=(pod.get("status") or {}).get("podIP") or "", namespace=meta.get("namespace", "default"),
                    labels=dict(meta.get("labels") or {}), ports=ports, node=spec.get("nodeName"),
                    name=meta.get("name", ""))


def from_store(select: Callable[[str, str, str], list[Mapping[str, Any]]]) -> tuple[Cluster, dict[str, Endpoint]]:
    """(Cluster, pods by IP) from an object store. ``select(group, version, plural)`` lists every stored object of
    that resource (all namespaces). Wiring into the API emulator's connection path, e.g. in the process kubelet
    or the HTTP client that dials pod IPs::

        from pdop_k8s_emulator import R
        cluster, by_ip = from_store(lambda g, v, p: api.select(R(g, v, p)))
        verdict = connection_allowed(cluster, src, by_ip[dst_ip], port)
        if not verdict:  # a real CNI drops the SYN: the client sees a connect timeout, not a refusal
            raise httpx.ConnectTimeout(verdict.reason)

    ``src`` is ``by_ip[...]`` for a pod, ``operator_endpoint(...)`` for a process standing in for a pod, or
    ``Endpoint(ip)`` for a client outside the cluster."""
    policies = list(select("networking.k8s.io", "v1", "networkpolicies"))
    namespaces = {(n.get("metadata") or {}).get("name", ""): dict((n.get("metadata") or {}).get("labels") or {})
                  for n in select("", "v1", "namespaces")}
    pods = [pod_endpoint(p) for p in select("", "v1", "pods")]
    return Cluster(policies, namespaces), {p.ip: p for p in pods if p.ip}


def operator_endpoint(namespace: str, labels: Mapping[str, str], ip: str = "10.244.0.5") -> Endpoint:
    """The operator's pod (as the chart runs it) as a connection source."""
    return Endpoint(ip=ip, namespace=namespace, labels=dict(labels), name="pdstack-operator")


def connection_check(api: Any) -> Callable[..., Verdict]:
    """A checker over an API emulator's live store (``api.select(R(group, version, plural))``), re-read per call:
    ``check(src, dst_ip, port, protocol="TCP")`` where ``src`` is a pod IP, another address (outside the cluster,
    or a node when ``node=`` names it), or an :class:`Endpoint`. The emulator's connection path (the process
    kubelet's HTTP dials, the operator's and Prometheus' reads of pod IPs) calls it before connecting and fails a
    denied connection the way a CNI drops it (a connect timeout)."""
    from pdop_k8s_emulator import R

    def check(src: str | Endpoint, dst_ip: str, port: int, protocol: str = "TCP", *,
              node: str | None = None) -> Verdict:
        cluster, by_ip = from_store(lambda g, v, p: api.select(R(g, v, p)))
        source = src if isinstance(src, Endpoint) else by_ip.get(src) or Endpoint(src, node=node)
        dest = by_ip.get(dst_ip) or Endpoint(dst_ip)
        return connection_allowed(cluster, source, dest, port, protocol)

    return check
