"""HTTP header names pdstack's router, operator and probes agree on (HTTP header names are case-insensitive)."""

ADMIN_TOKEN_HEADER = "X-PDStack-Admin-Token"  # the admin token where Authorization cannot carry it (pods/proxy)
PIN_HEADER = "X-PDStack-Pair"  # pin a request to one group (canary probes); needs admin credentials
REQUEST_ID_HEADER = "X-Request-Id"  # a client's own id; the router shows it as client_request_id
CLIENT_CONNECTION_HEADER = "X-PDStack-Client-Connection"  # router -> both legs: the client's "host:port"
