"""The OpenAI wire format, jax-free: request and response bodies, structured output and tool calls, the HTTP helpers and metrics that the server and the router share."""
