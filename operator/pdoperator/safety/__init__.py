"""Rollout safety: ``canary`` decides (canary, known-good, auto-rollback; pure), ``rollout`` does it against the
cluster (the background probe, the known-good annotation, the rollback patch) for one reconcile's context."""
