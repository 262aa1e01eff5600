"""`dspark serve`: an OpenAI-compatible HTTP server over the batched engine.

    protocol.py    request validation (OpenAI field names) and response/chunk bodies
    prompts.py     tokenizing and the context check, on their own threads before the worker
    worker.py      the one thread that owns the Engine; commands in, tokens out
    prometheus.py  the /metrics registry (one per app)
    app.py         FastAPI routes: create_app(engine, ...)

Its flags and the uvicorn start-up are the command layer's (dspark/cli/serve.py).
"""
