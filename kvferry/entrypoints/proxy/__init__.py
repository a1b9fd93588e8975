"""The P/D proxy: an OpenAI-compatible front that sends each request to a prefill
instance (max_tokens=1, ``kv_transfer_params={"do_remote_decode": true}``), then to a
decode instance with the prefill's ``kv_transfer_params`` (DESIGN.md section 5); to a
layer-wise prefill instance, both at once (layerwise.py).

    config.py     ProxyConfig (frozen)
    errors.py     typed proxy errors and OpenAI error bodies
    pool.py       instances, selection policies (round_robin, least_loaded), in-flight counts
    health.py     periodic /health checks of every instance
    upstream.py   httpx calls to instances: JSON, SSE streams, retry on refused connections
    pd.py         request shaping: prefill and decode bodies, batches split into legs, merging
    streaming.py  streamed answers: the prefill's first token at once, then the decoder's
    layerwise.py  layer-wise legs: a prefill instance's source, a transfer id, both legs at once
    metrics.py    the proxy's Prometheus metrics
    app.py        the FastAPI app
    main.py       ``kvferry proxy`` (add_args / run)
"""
