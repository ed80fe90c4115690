"""pdrt servers: prefill worker, decode worker, router; `pdrt serve|up|chat` commands."""
