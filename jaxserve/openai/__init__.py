"""The OpenAI wire format, jax-free, shared by the server and the router: `requests` (bodies checked into prompts and
SamplingParams; chat's messages in `chat_messages`), `responses` (outputs into response and stream-chunk bodies),
`errors` (the error bodies), `structured` and `tool_calls` / `tool_parsers` (structured output and tool calls; the
auto formats by vLLM's parser names in `tool_call_parsers`: `tool_json_formats`, `tool_xml_format`), `http` (the
HTTP helpers both sides use) and `metrics`."""
