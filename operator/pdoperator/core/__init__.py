"""The operator's pure core: everything that decides takes data and returns data, with no I/O.

``spec`` (the typed, validated PDDeployment), ``render`` (spec + revision -> children), ``revisions`` (hash,
history, diffs, the known-good rule), ``pairs`` (observed pods -> actions; the pod-readiness rule), ``drift``
(what someone else changed, as ``status.drift`` entries), ``status`` (conditions), ``stall`` (stall evidence),
``config`` (the operator's typed settings), ``rbac`` (its least-privilege rules), ``peering`` (HA standby).
"""
