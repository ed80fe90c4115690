"""PD-disaggregation protocol: transfer states, KV wire format, prefill/decode queues, watchdogs."""
