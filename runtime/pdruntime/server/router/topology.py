"""Router topology: which PD pairs exist, where their workers listen, and which are ready.

Source: CLI flags or a YAML file (written by the operator into the router ConfigMap, key
``topology.yaml``) that the router hot-reloads. Format::

    version: 1
    generation: 7        # topology version: the operator bumps it on every change (newest wins)
    revision: "abc123"
    pairs:
      - index: 0
        ready: true
        draining: false  # true: finish in-flight requests, take no new ones (pods go after the router confirms)
        canary: false    # true: no normal traffic; only requests pinned to its group (X-PDStack-Pair) reach it
        prefill: {url: "http://10.0.0.11:8000", bootstrap_host: "10.0.0.11", bootstrap_port: 8998}
        decode:  {url: "http://10.0.0.12:8000"}
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlparse

import yaml

from pdruntime.util.periodic import PeriodicTask

log = logging.getLogger("pdruntime.topology")


class TopologyError(ValueError):
    """The topology is malformed; the message names the field and what is accepted."""


@dataclass(frozen=True)
class Pair:
    index: int
    ready: bool
    prefill_url: str
    bootstrap_host: str
    bootstrap_port: int
    decode_url: str
    draining: bool = False  # no new requests; in-flight ones finish (a draining pair is never ready)
    group: int | None = None  # the P:D group this (prefill, decode) combination belongs to; None = its own
    canary: bool = False  # only pinned requests (X-PDStack-Pair: <group>) reach it, never normal traffic

    @property
    def group_id(self) -> int:
        return self.index if self.group is None else self.group

    @property
    def key(self) -> str:
        return str(self.index)


@dataclass(frozen=True)
class Topology:
    version: int
    revision: str
    pairs: tuple[Pair, ...]
    generation: int = 0  # the topology version the operator published (monotonic per deployment)

    def draining(self) -> list[int]:
        return [p.index for p in self.pairs if p.draining]

    def ready_pairs(self) -> list[Pair]:
        return [p for p in self.pairs if p.ready]

    def as_dict(self) -> dict:
        return {"version": self.version, "generation": self.generation, "revision": self.revision, "pairs": [
            {"index": p.index, "ready": p.ready, "draining": p.draining, "canary": p.canary,
             **({"group": p.group} if p.group is not None else {}),
             "prefill": {"url": p.prefill_url, "bootstrap_host": p.bootstrap_host, "bootstrap_port": p.bootstrap_port},
             "decode": {"url": p.decode_url}} for p in self.pairs]}


def _url(value: Any, where: str) -> str:
    if not isinstance(value, str) or urlparse(value).scheme not in ("http", "https") or not urlparse(value).hostname:
        raise TopologyError(f"{where}: {value!r} is not accepted; accepted: an http(s) URL like http://10.0.0.11:8000")
    return value.rstrip("/")


def parse_topology(doc: Any) -> Topology:
    if not isinstance(doc, dict):
        raise TopologyError("topology: expected a mapping with version, revision and pairs")
    version = doc.get("version", 1)
    if version != 1:
        raise TopologyError(f"topology.version: {version!r} is not accepted; accepted: 1")
    revision = str(doc.get("revision", ""))
    generation = doc.get("generation", 0)
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise TopologyError(f"topology.generation: {generation!r} is not accepted; accepted: an integer >= 0")
    raw_pairs = doc.get("pairs")
    if not isinstance(raw_pairs, list):
        raise TopologyError("topology.pairs: expected a list of pairs")
    pairs: list[Pair] = []
    seen: set[int] = set()
    for i, rp in enumerate(raw_pairs):
        where = f"topology.pairs[{i}]"
        if not isinstance(rp, dict):
            raise TopologyError(f"{where}: expected a mapping with index, prefill and decode")
        index = rp.get("index", i)
        if not isinstance(index, int) or isinstance(index, bool) or index < 0 or index in seen:
            raise TopologyError(f"{where}.index: {index!r} is not accepted; accepted: a unique integer >= 0")
        seen.add(index)
        ready = rp.get("ready", True)
        if not isinstance(ready, bool):
            raise TopologyError(f"{where}.ready: {ready!r} is not accepted; accepted: true or false")
        draining = rp.get("draining", False)
        if not isinstance(draining, bool):
            raise TopologyError(f"{where}.draining: {draining!r} is not accepted; accepted: true or false")
        canary = rp.get("canary", False)
        if not isinstance(canary, bool):
            raise TopologyError(f"{where}.canary: {canary!r} is not accepted; accepted: true or false")
        pre = rp.get("prefill")
        dec = rp.get("decode")
        if not isinstance(pre, dict) or not isinstance(dec, dict):
            raise TopologyError(f"{where}: prefill and decode must be mappings")
        if not (ready and not draining) and (pre.get("url") is None or dec.get("url") is None):
            continue  # a pair still being created (no pod IPs yet): nothing to route to
        purl = _url(pre.get("url"), f"{where}.prefill.url")
        bhost = pre.get("bootstrap_host") or urlparse(purl).hostname
        bport = pre.get("bootstrap_port", 8998)
        if not isinstance(bport, int) or isinstance(bport, bool) or not 0 < bport < 65536:
            raise TopologyError(f"{where}.prefill.bootstrap_port: {bport!r} is not accepted; accepted: a port 1..65535")
        group = rp.get("group")
        if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 0):
            raise TopologyError(f"{where}.group: {group!r} is not accepted; accepted: an integer >= 0 (the P:D "
                                "group of this prefill/decode combination)")
        pairs.append(Pair(index, ready and not draining, purl, str(bhost), bport,
                          _url(dec.get("url"), f"{where}.decode.url"), draining, group, canary))
    return Topology(1, revision, tuple(pairs), generation)


def load_topology_text(text: str) -> Topology:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TopologyError(f"topology file is not valid YAML: {exc}") from None
    return parse_topology(doc)


def topology_from_flags(prefill: list[str], decode: list[str], bootstrap_ports: list[int]) -> Topology:
    """Pairs from ``--prefill URL --decode URL [--bootstrap-port N]`` flags, matched by position."""
    if len(prefill) != len(decode):
        raise TopologyError(f"{len(prefill)} --prefill URLs and {len(decode)} --decode URLs; accepted: one of each per pair")
    pairs = []
    for i, (p, d) in enumerate(zip(prefill, decode)):
        port = bootstrap_ports[i] if i < len(bootstrap_ports) else (bootstrap_ports[-1] if bootstrap_ports else 8998)
        pairs.append({"index": i, "prefill": {"url": p, "bootstrap_port": port}, "decode": {"url": d}})
    return parse_topology({"version": 1, "revision": "flags", "pairs": pairs})


class TopologyWatcher:
    """Polls a topology file and calls ``on_change(topology)`` when its content changes.

    ConfigMap volumes update by swapping a symlink, so this compares content hashes, not mtimes.
    A bad file keeps the last good topology and is logged and counted.
    """

    def __init__(self, path: str, on_change: Callable[[Topology], None], on_error: Callable[[str], None],
                 interval_s: float = 1.0) -> None:
        self.path = path
        self.on_change = on_change
        self.on_error = on_error
        self.interval_s = interval_s
        self.digest: str | None = None
        self.last_error: str | None = None
        self._ticker = PeriodicTask(self.load_now, interval_s, name="topology-watcher")

    def load_now(self) -> Topology | None:
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            self._error(f"cannot read topology file {self.path}: {exc}")
            return None
        digest = hashlib.sha256(data).hexdigest()
        if digest == self.digest:
            return None
        try:
            topo = load_topology_text(data.decode("utf-8", errors="replace"))
        except TopologyError as exc:
            self.digest = digest  # do not re-log the same bad content every interval
            self._error(f"{self.path}: {exc}")
            return None
        self.digest = digest
        self.last_error = None
        self.on_change(topo)
        return topo

    def _error(self, msg: str) -> None:
        if msg != self.last_error:
            log.error("topology not reloaded: %s", msg)
        self.last_error = msg
        self.on_error(msg)

    def start(self) -> None:
        """Re-read the file every ``interval_s`` (idempotent)."""
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()
