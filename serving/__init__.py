"""serving: what stands between clients and the engine.

    prompts     operator input (text, chat messages, token ids) to the exact ids the model sees
    schemas     the OpenAI-compatible request bodies (pydantic) and their bounds
    errors      OpenAI's error body and the statuses the API answers with
    gateway     the bridge from the API's event loop to the engine thread (submit, route, abort)
    generation  one API request's choices as they come out: text, token ids, stop sequences
    api         the FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /metrics
    server      uvicorn on 127.0.0.1, on a thread (the console) or in the foreground (`python -m cli serve`)
"""
