"""The NetworkPolicy evaluator (netpol.py), table-tested against the examples of the Kubernetes documentation
(content/en/docs/concepts/services-networking/network-policies.md and content/en/examples/service/networking/
network-policy-*.yaml), each policy as the docs give it and each row one statement the docs make about it."""

from __future__ import annotations

import pytest
import yaml

from netpol import Cluster, Endpoint, connection_allowed, ip_in_block, pod_endpoint, policy_types, selector_matches

# The docs' first example, verbatim.
TEST_NETWORK_POLICY = yaml.safe_load("""
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: test-network-policy
  namespace: default
spec:
  podSelector:
    matchLabels:
      role: db
  policyTypes:
  - Ingress
  - Egress
  ingress:
  - from:
    - ipBlock:
        cidr: 172.17.0.0/16
        except:
        - 172.17.1.0/24
    - namespaceSelector:
        matchLabels:
          project: myproject
    - podSelector:
        matchLabels:
          role: frontend
    ports:
    - protocol: TCP
      port: 6379
  egress:
  - to:
    - ipBlock:
        cidr: 10.0.0.0/24
    ports:
    - protocol: TCP
      port: 5978
""")

NAMESPACES = {"default": {}, "proj": {"project": "myproject"}, "other": {}, "alice-ns": {"user": "alice"},
              "bob-ns": {"user": "bob"}, "monitoring": {}}
DB = Endpoint("10.244.1.10", "default", {"role": "db"}, {("redis", "TCP"): 6379}, name="db")
FRONTEND = Endpoint("10.244.1.11", "default", {"role": "frontend"}, name="frontend")
OTHER_DEFAULT = Endpoint("10.244.1.12", "default", {"role": "batch"}, name="batch")
IN_PROJECT = Endpoint("10.244.2.10", "proj", {"anything": "x"}, name="p")
FRONTEND_ELSEWHERE = Endpoint("10.244.3.10", "other", {"role": "frontend"}, name="fe2")


def ext(ip: str) -> Endpoint:
    return Endpoint(ip)


@pytest.mark.parametrize("src, dst, port, proto, allowed, statement", [
    (FRONTEND, DB, 6379, "TCP", True, "any pod in default with role=frontend, on TCP 6379"),
    (FRONTEND, DB, 6380, "TCP", False, "only TCP port 6379"),
    (FRONTEND, DB, 6379, "UDP", False, "only TCP"),
    (IN_PROJECT, DB, 6379, "TCP", True, "any pod in a namespace labelled project=myproject"),
    (FRONTEND_ELSEWHERE, DB, 6379, "TCP", False, "podSelector alone: pods of the policy's own namespace only"),
    (OTHER_DEFAULT, DB, 6379, "TCP", False, "db pods are isolated: anything not allowed is rejected"),
    (ext("172.17.0.5"), DB, 6379, "TCP", True, "172.17.0.0-172.17.0.255"),
    (ext("172.17.1.5"), DB, 6379, "TCP", False, "except 172.17.1.0/24"),
    (ext("172.17.2.200"), DB, 6379, "TCP", True, "172.17.2.0-172.17.255.255"),
    (ext("172.18.0.1"), DB, 6379, "TCP", False, "outside the cidr"),
    (DB, ext("10.0.0.7"), 5978, "TCP", True, "egress: db to 10.0.0.0/24 on TCP 5978"),
    (DB, ext("10.0.0.7"), 5979, "TCP", False, "egress: that port only"),
    (DB, ext("10.0.1.7"), 5978, "TCP", False, "egress: that CIDR only"),
    (DB, FRONTEND, 5978, "TCP", False, "egress isolated: a pod outside 10.0.0.0/24 is not a destination"),
    (OTHER_DEFAULT, FRONTEND, 80, "TCP", True, "pods no policy selects accept all traffic"),
    (FRONTEND, ext("8.8.8.8"), 53, "UDP", True, "and send anywhere (not isolated for egress)"),
])
def test_the_docs_first_example(src, dst, port, proto, allowed, statement):
    v = connection_allowed(Cluster([TEST_NETWORK_POLICY], NAMESPACES), src, dst, port, proto)
    assert v.allowed is allowed, f"{statement}: {v.reason}"


def _ingress_from(*peers) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": {"role": "db"}}, "ingress": [{"from": list(peers)}]}}


ALICE = {"namespaceSelector": {"matchLabels": {"user": "alice"}}}
CLIENT = {"podSelector": {"matchLabels": {"role": "client"}}}


@pytest.mark.parametrize("policy, src, allowed, statement", [
    (_ingress_from({**ALICE, **CLIENT}), Endpoint("10.1.0.1", "alice-ns", {"role": "client"}), True,
     "one element with both: role=client pods in user=alice namespaces"),
    (_ingress_from({**ALICE, **CLIENT}), Endpoint("10.1.0.2", "alice-ns", {"role": "server"}), False,
     "one element: both must match (pod labels)"),
    (_ingress_from({**ALICE, **CLIENT}), Endpoint("10.1.0.3", "default", {"role": "client"}), False,
     "one element: both must match (namespace labels)"),
    (_ingress_from(ALICE, CLIENT), Endpoint("10.1.0.3", "default", {"role": "client"}), True,
     "two elements: role=client in the local namespace"),
    (_ingress_from(ALICE, CLIENT), Endpoint("10.1.0.2", "alice-ns", {"role": "server"}), True,
     "two elements: or any pod in a user=alice namespace"),
    (_ingress_from(ALICE, CLIENT), Endpoint("10.1.0.4", "bob-ns", {"role": "client"}), False,
     "two elements: role=client elsewhere is neither"),
])
def test_behaviour_of_to_and_from_selectors(policy, src, allowed, statement):
    v = connection_allowed(Cluster([policy], NAMESPACES), src, DB, 6379)
    assert v.allowed is allowed, f"{statement}: {v.reason}"


DEFAULT_DENY_INGRESS = {"metadata": {"name": "default-deny-ingress", "namespace": "default"},
                        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
ALLOW_ALL_INGRESS = {"metadata": {"name": "allow-all-ingress", "namespace": "default"},
                     "spec": {"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]}}
DEFAULT_DENY_EGRESS = {"metadata": {"name": "default-deny-egress", "namespace": "default"},
                       "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
ALLOW_ALL_EGRESS = {"metadata": {"name": "allow-all-egress", "namespace": "default"},
                    "spec": {"podSelector": {}, "egress": [{}], "policyTypes": ["Egress"]}}
DEFAULT_DENY_ALL = {"metadata": {"name": "default-deny-all", "namespace": "default"},
                    "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}
ALLOW_EGRESS_DENY_INGRESS = {"metadata": {"name": "allow-egress-deny-ingress", "namespace": "default"},
                             "spec": {"podSelector": {}, "policyTypes": ["Egress", "Ingress"], "egress": [{}],
                                      "ingress": []}}
MULTI_PORT_EGRESS = yaml.safe_load("""
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: multi-port-egress
  namespace: default
spec:
  podSelector:
    matchLabels:
      role: db
  policyTypes:
  - Egress
  egress:
  - to:
    - ipBlock:
        cidr: 10.0.0.0/24
    ports:
    - protocol: TCP
      port: 32000
      endPort: 32768
""")
OUTSIDE = Endpoint("10.244.9.9", "other", {"role": "client"}, name="c")


@pytest.mark.parametrize("policies, src, dst, port, proto, allowed, statement", [
    ([DEFAULT_DENY_INGRESS], OUTSIDE, FRONTEND, 80, "TCP", False, "default deny ingress: every pod isolated"),
    ([DEFAULT_DENY_INGRESS], FRONTEND, DB, 6379, "TCP", False, "even from the same namespace"),
    ([DEFAULT_DENY_INGRESS], FRONTEND, ext("1.1.1.1"), 443, "TCP", True, "it does not change egress"),
    ([DEFAULT_DENY_INGRESS, ALLOW_ALL_INGRESS], OUTSIDE, FRONTEND, 80, "TCP", True,
     "allow all ingress: policies are additive"),
    ([DEFAULT_DENY_EGRESS], FRONTEND, ext("1.1.1.1"), 443, "TCP", False, "default deny egress"),
    ([DEFAULT_DENY_EGRESS], FRONTEND, DB, 6379, "TCP", False, "also to pods: egress at the source must allow"),
    ([DEFAULT_DENY_EGRESS], OUTSIDE, FRONTEND, 80, "TCP", True, "it does not change ingress"),
    ([DEFAULT_DENY_EGRESS, ALLOW_ALL_EGRESS], FRONTEND, ext("1.1.1.1"), 443, "TCP", True, "allow all egress"),
    ([DEFAULT_DENY_ALL], FRONTEND, ext("1.1.1.1"), 443, "TCP", False, "default deny all: egress"),
    ([DEFAULT_DENY_ALL], OUTSIDE, FRONTEND, 80, "TCP", False, "default deny all: ingress"),
    ([ALLOW_EGRESS_DENY_INGRESS], FRONTEND, ext("1.1.1.1"), 443, "TCP", True, "allow all egress, deny ingress: out"),
    ([ALLOW_EGRESS_DENY_INGRESS], OUTSIDE, FRONTEND, 80, "TCP", False, "allow all egress, deny ingress: in"),
    ([MULTI_PORT_EGRESS], DB, ext("10.0.0.3"), 32000, "TCP", True, "port range: first port"),
    ([MULTI_PORT_EGRESS], DB, ext("10.0.0.3"), 32768, "TCP", True, "port range: endPort is inclusive"),
    ([MULTI_PORT_EGRESS], DB, ext("10.0.0.3"), 32769, "TCP", False, "port range: past endPort"),
    ([MULTI_PORT_EGRESS], DB, ext("10.0.0.3"), 31999, "TCP", False, "port range: before port"),
    ([MULTI_PORT_EGRESS], DB, ext("10.0.0.3"), 32000, "UDP", False, "port range: TCP only"),
    ([MULTI_PORT_EGRESS], FRONTEND, ext("10.0.9.3"), 1, "TCP", True, "not role=db: not isolated"),
])
def test_default_policies_and_port_ranges(policies, src, dst, port, proto, allowed, statement):
    v = connection_allowed(Cluster(policies, NAMESPACES), src, dst, port, proto)
    assert v.allowed is allowed, f"{statement}: {v.reason}"


def test_policy_types_default_to_ingress_plus_egress_when_egress_rules_exist():
    assert policy_types({"spec": {"podSelector": {}}}) == ("Ingress",)
    assert policy_types({"spec": {"podSelector": {}, "egress": [{}]}}) == ("Ingress", "Egress")
    assert policy_types({"spec": {"policyTypes": ["Egress"]}}) == ("Egress",)
    # no policyTypes, egress rules only: ingress is isolated too, with no ingress rule (deny)
    egress_only = {"metadata": {"name": "e", "namespace": "default"},
                   "spec": {"podSelector": {}, "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}]}}
    assert not connection_allowed(Cluster([egress_only]), OUTSIDE, FRONTEND, 80)
    assert connection_allowed(Cluster([egress_only]), FRONTEND, ext("10.1.2.3"), 80)
    assert not connection_allowed(Cluster([egress_only]), FRONTEND, ext("192.168.0.1"), 80)


def test_a_namespace_by_name_through_the_automatic_label():
    """kubernetes.io/metadata.name is set on every namespace by the API server: selectable without labelling."""
    pol = _ingress_from({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}})
    prom = Endpoint("10.9.0.1", "monitoring", {"app": "prometheus"})
    assert connection_allowed(Cluster([pol], {}), prom, DB, 6379)
    assert not connection_allowed(Cluster([pol], {}), OUTSIDE, DB, 6379)


def test_named_ports_resolve_on_the_destination_pod():
    pol = {"metadata": {"name": "named", "namespace": "default"},
           "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": "http"}]}]}}
    a = Endpoint("10.0.0.1", "default", {}, {("http", "TCP"): 8000}, name="a")
    b = Endpoint("10.0.0.2", "default", {}, {("http", "TCP"): 9000}, name="b")
    c = Cluster([pol])
    assert connection_allowed(c, OUTSIDE, a, 8000) and not connection_allowed(c, OUTSIDE, a, 9000)
    assert connection_allowed(c, OUTSIDE, b, 9000) and not connection_allowed(c, OUTSIDE, b, 8000)
    assert not connection_allowed(c, OUTSIDE, a, 8000, "UDP")  # the name is (name, protocol)
    egress = {"metadata": {"name": "eg", "namespace": "other"},
              "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"ports": [{"port": "http"}]}]}}
    assert connection_allowed(Cluster([egress]), OUTSIDE, b, 9000)  # egress: named on the peer pod
    assert not connection_allowed(Cluster([egress]), OUTSIDE, b, 8000)


@pytest.mark.parametrize("expr, labels, matches", [
    ({"key": "tier", "operator": "In", "values": ["a", "b"]}, {"tier": "a"}, True),
    ({"key": "tier", "operator": "In", "values": ["a", "b"]}, {}, False),
    ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {"tier": "c"}, True),
    ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {}, True),  # absent key: not in the set
    ({"key": "tier", "operator": "NotIn", "values": ["a"]}, {"tier": "a"}, False),
    ({"key": "tier", "operator": "Exists"}, {"tier": ""}, True),
    ({"key": "tier", "operator": "DoesNotExist"}, {"tier": "a"}, False),
])
def test_match_expressions(expr, labels, matches):
    assert selector_matches({"matchExpressions": [expr]}, labels) is matches
    assert selector_matches({}, labels) is True  # the empty selector selects everything


def test_ip_blocks_and_the_exceptions_that_always_hold():
    assert ip_in_block("172.17.255.255", {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]})
    assert not ip_in_block("fd00::1", {"cidr": "172.17.0.0/16"})
    assert ip_in_block("fd00::1", {"cidr": "fd00::/8"})
    deny = Cluster([DEFAULT_DENY_ALL])
    me = Endpoint("10.0.0.5", "default", {}, name="me", node="n1")
    assert connection_allowed(deny, me, me, 80), "a pod cannot block access to itself"
    assert connection_allowed(deny, Endpoint("192.168.0.10", node="n1"), me, 80), "its node (kubelet probes)"
    assert not connection_allowed(deny, Endpoint("192.168.0.11", node="n2"), me, 80)


def test_a_peer_that_sets_nothing_is_refused_not_read_as_everything():
    with pytest.raises(ValueError, match="accepted: podSelector"):
        connection_allowed(Cluster([_ingress_from({})]), FRONTEND, DB, 6379)


def test_endpoints_from_stored_pods():
    pod = {"metadata": {"name": "w", "namespace": "ns", "labels": {"a": "b"}},
           "spec": {"nodeName": "n", "containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
           "status": {"podIP": "10.0.0.9"}}
    e = pod_endpoint(pod)
    assert (e.ip, e.namespace, e.labels, e.node) == ("10.0.0.9", "ns", {"a": "b"}, "n")
    assert e.ports == {("http", "TCP"): 8000}


async def test_connection_check_reads_the_emulators_store():
    """The wiring for the emulator's connection path: policies, pods and namespaces as stored, per call."""
    from netpol import connection_check
    from pdop_k8s_emulator import PDEmulator, R

    pods, pols = R("", "v1", "pods"), R("networking.k8s.io", "v1", "networkpolicies")
    async with PDEmulator() as api:
        for name, labels, ip in (("db", {"role": "db"}, "10.1.0.1"), ("fe", {"role": "frontend"}, "10.1.0.2"),
                                 ("x", {"role": "other"}, "10.1.0.3")):
            api._create(pods, "default", {"metadata": {"name": name, "labels": labels},
                                          "spec": {"containers": [{"name": "c", "image": "i:1"}]}})
            api._store(pods, "default", name, {"status": {"podIP": ip}}, subresource="status")
        check = connection_check(api)
        assert check("10.1.0.3", "10.1.0.1", 6379), "no policy yet: open"
        api._create(pols, "default", TEST_NETWORK_POLICY)
        assert check("10.1.0.2", "10.1.0.1", 6379) and not check("10.1.0.3", "10.1.0.1", 6379)
        assert check("172.17.0.9", "10.1.0.1", 6379) and not check("172.17.1.9", "10.1.0.1", 6379)
