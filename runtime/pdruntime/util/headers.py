"""HTTP header names pdstack's router, workers, operator and probes agree on.

Lower case, as HTTP/2 and ASGI carry them (names are case-insensitive on the wire; plain-dict lookups are not).
"""

ADMIN_TOKEN_HEADER = "x-pdstack-admin-token"  # the admin token where Authorization cannot carry it (pods/proxy)
PIN_HEADER = "x-pdstack-pair"  # pin a request to one group (canary probes); needs admin credentials
REQUEST_ID_HEADER = "x-request-id"  # a client's own id; the router shows it as client_request_id
CLIENT_CONNECTION_HEADER = "x-pdstack-client-connection"  # router -> decode leg: the client's "host:port"
DEADLINE_HEADER = "x-pdstack-deadline-s"  # router -> prefill leg: seconds left of the request's deadline at sending
#: router -> decode leg: seconds decode may gather token events into one after the first (the router sends it for
#: a client that asked for one response, not a stream: fewer events to relay; progress still reported this often)
STREAM_INTERVAL_HEADER = "x-pdstack-stream-interval-s"
#: router -> decode leg: seconds decode may wait for KV pages before it answers 429 (busy): what is left of the
#: router's --admission-wait-s for this request, so that a request waits for capacity at most that long after its
#: arrival, in the router's queue and in decode together
BUSY_WAIT_HEADER = "x-pdstack-busy-wait-s"
