"""The tokenizer process: trident's HTTP front door.

It owns everything a client sees and nothing the GPU needs:

- `__main__`: process start-up (tokenizer load, scheduler handshake, uvicorn, ready report).
- `app`: the FastAPI application, its middleware (API key, body size, CORS) and error handlers.
- `openai_api` / `openai_format`: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.
- `chat_output`: a chat choice's text as reasoning, content and tool calls, streamed or not,
  through `reasoning` (`<think>`) and the call parser `tool_formats` chooses: `tool_parsers`
  (the JSON families), `pythonic_calls` or `xml_calls` (Qwen3-Coder's); `tools` holds the
  tool plan and its prompt, and
  `tool_grammar` the forced-call constraint in the family's format.
- `tokenize_api`: vLLM's `/tokenize` and `/detokenize`.
- `responses_*`: OpenAI's Responses API (its store, background responses); `messages_*`:
  Anthropic's Messages API; `embeddings_api`, `invocations_api`: the rest of the routes.
- `native_api`: SGLang-style `/generate`, `/abort`, `/flush_cache`, `/server_info`, `/health_generate`.
- `protocol` / `sampling`: request models and their validation into `wire.frontend.SamplingParams`.
- `request_manager`: the open requests by rid, the sockets to and from the scheduler.
- `detokenizer`: incremental text per request, UTF-8 hold-back and stop strings.
- `metrics`: the Prometheus registry of this process.
- `offline`: the whole interface the offline Engine (trident/engine.py) uses of this process.

The scheduler owns queueing, KV and every decision about a running request; this process
holds only what it needs to turn token ids into HTTP responses.
"""
