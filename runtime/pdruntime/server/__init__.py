"""pdrt servers: ``router/`` (the PD router), ``worker/`` (prefill and decode workers), ``openai/`` (the
OpenAI/SGLang request and response surface), ``local/`` (``pdrt up`` process supervision); ``edge`` is the HTTP
plumbing they share, ``commands`` the ``pdrt serve|up|chat`` commands (``python -m pdruntime.server``)."""
