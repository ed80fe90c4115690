"""The PD router: OpenAI API in front of prefill/decode pairs (legs, routing policy, topology, worker health)."""
