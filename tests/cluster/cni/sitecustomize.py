"""The test cluster's CNI, inside each pod process the process kubelet starts (this directory leads its
PYTHONPATH, so Python imports this module at start-up).

Every outgoing TCP connect to an address of the pod network (``$PDSTACK_CNI_POD_CIDR``) asks the kubelet's
policy endpoint (``$PDSTACK_CNI_URL``: ``netpol.connection_check`` over the stored NetworkPolicies, with this
pod's IP ``$PDSTACK_CNI_POD_IP`` as the source) before connecting. A denied connection is dropped the way an
enforcing CNI drops the SYN: nothing answers, and the client's own connect timeout fires (``socket.timeout`` /
``TimeoutError``; an async connect waits until the caller's timeout cancels it). Connections to addresses
outside the pod network (the API server, the policy endpoint) and to the pod itself are not checked.
Without ``$PDSTACK_CNI_URL`` this module does nothing.
"""

import os

if os.environ.get("PDSTACK_CNI_URL"):
    import asyncio
    import asyncio.selector_events
    import errno
    import http.client
    import ipaddress
    import json
    import socket
    import time
    import urllib.parse

    _URL = urllib.parse.urlsplit(os.environ["PDSTACK_CNI_URL"])
    _SRC = os.environ["PDSTACK_CNI_POD_IP"]
    _NET = ipaddress.ip_network(os.environ["PDSTACK_CNI_POD_CIDR"])
    _SYN_RETRIES_S = 127.0  # Linux's default tcp_syn_retries=6: a dropped SYN times out after ~127 s
    _connect = socket.socket.connect
    _sock_connect = asyncio.selector_events.BaseSelectorEventLoop.sock_connect

    def _denied(address: object) -> "str | None":
        """The policy's reason when ``address`` may not be reached from this pod, else None."""
        if not isinstance(address, tuple) or len(address) < 2:
            return None
        try:
            ip = ipaddress.ip_address(address[0])
        except ValueError:
            return None
        if ip not in _NET or str(ip) == _SRC:
            return None
        query = urllib.parse.urlencode({"src": _SRC, "dst": str(ip), "port": int(address[1])})
        conn = http.client.HTTPConnection(_URL.hostname, _URL.port, timeout=10)
        try:
            conn.request("GET", f"/v1/verdict?{query}")
            verdict = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return None if verdict["allowed"] else verdict["reason"]

    def connect(self: socket.socket, address: object) -> None:
        why = _denied(address)
        if why is not None:
            timeout = self.gettimeout()
            if timeout == 0.0:
                raise BlockingIOError(errno.EINPROGRESS, "Operation now in progress")  # never completes
            time.sleep(_SYN_RETRIES_S if timeout is None else timeout)
            raise socket.timeout(f"timed out (dropped: {why})")
        return _connect(self, address)

    async def sock_connect(self: asyncio.AbstractEventLoop, sock: socket.socket, address: object) -> None:
        why = _denied(address)
        if why is not None:
            await asyncio.sleep(_SYN_RETRIES_S)
            raise TimeoutError(errno.ETIMEDOUT, f"Connection timed out (dropped: {why})")
        return await _sock_connect(self, sock, address)

    socket.socket.connect = connect  # type: ignore[method-assign]
    asyncio.selector_events.BaseSelectorEventLoop.sock_connect = sock_connect  # type: ignore[method-assign]

    # uvloop connects in libuv's C code, past both hooks above: a pod process on it (the router takes uvloop where
    # installed) would reach every worker whatever the policy says. A real CNI judges the SYN in the kernel, for any
    # loop; this one can only judge what Python connects, so its pods run asyncio's loop (uvloop unimportable).
    import sys

    sys.modules["uvloop"] = None  # type: ignore[assignment]
