"""Prefill and decode workers: the engine thread, prompt handling, KV transfer and their HTTP routes."""
