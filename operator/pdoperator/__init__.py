"""pdstack operator: reconciles PDDeployments into prefill/decode pairs (see docs/operator.md)."""
