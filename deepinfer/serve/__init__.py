"""`deepinfer serve`: an OpenAI-compatible server over one engine core, and `deepinfer bench serve`.

* `deepinfer.serve.server`: the command (flags, engine, uvicorn);
* `deepinfer.serve.app`: the FastAPI routes, auth, body limits, error shape;
* `deepinfer.serve.handlers`: completions / chat bodies -> engine requests -> responses and SSE;
* `deepinfer.serve.protocol`: field checks naming the field, OpenAI errors;
* `deepinfer.serve.metrics`: Prometheus collectors for ``/metrics``;
* `deepinfer.serve.bench`: the open-loop load generator.

Nothing is imported here: ``deepinfer --help`` must not pay for FastAPI.
"""
