"""What kvcomm's parts inside vLLM tell each other: plain values, checked where they are read,
and no behaviour. ``params``: a request's ``kv_transfer_params["kvcomm"]`` (client to server);
``config``: the connector's settings and how vLLM loads it (vLLM's config to every side);
``messages``: the step's metadata (scheduler side to worker side); ``channel``: orders and
captures between in-process callers and the connector (one per engine and process)."""
