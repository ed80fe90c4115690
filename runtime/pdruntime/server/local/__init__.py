"""Local process supervision: ``pdrt up`` runs a router and N pairs as child processes and co-restarts pairs."""
