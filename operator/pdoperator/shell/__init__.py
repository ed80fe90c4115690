"""The kopf shell: ``handlers`` (kopf wiring: one daemon per PDDeployment), ``reconcile`` (observe, plan, act,
report), ``context`` (what one reconcile carries), ``state`` (one ``DeploymentState`` per PDDeployment), ``kube``
(the API client), ``routerlink`` (HTTP to router and worker pods), ``metrics`` (the operator's own)."""
