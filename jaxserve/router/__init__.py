"""`jaxserve router`: the OpenAI API over separate prefill and decode servers (prefill/decode disaggregation across
processes or hosts; `jaxserve serve --role prefill|decode`).

Each completion or chat request goes to the least-loaded healthy prefill server with `kv_transfer_params:
{do_remote_decode: true}`; that server computes the prompt and the first token, holds the request's KV pages for
the transfer, and answers with the first token and where to fetch them. Unless that token ended the request, the
router sends it on to the least-loaded decode server with `{do_remote_prefill: true, ...}`, which fetches the pages
and streams what follows. The client gets the first token as soon as the prefill answers, then the decode stream.

Faults: a prefill server that cannot be reached, resets, hangs (past prefill_timeout_s) or answers 5xx is retried
once on another; a decode failure ends the request with an OpenAI-style error (an error event once its stream has
started); a server's 4xx is forwarded as it is. /health is 200 while each pool has a healthy server, with each
pool's counts (never the servers' addresses) in its body; /metrics holds the router's own series. One sequence per
request (n = 1, one prompt): the prefill servers refuse more with a 400.

`pool` is the servers of one role, `proxy` one request's way through both, `joined` the two servers' answers made
into the client's, `upstream` what a server's answer or failure means to the router, `app` the HTTP side (`PDRouter`),
`metrics` the router's Prometheus series. The `kv_transfer_params` it passes are typed in
`jaxserve.openai.kv_transfer_params`, shared with the servers, and MACed under the secret the router and the servers
share (`--kv-transfer-secret`): the role servers serve the router only.
"""
from jaxserve.router.app import PDRouter, serve_router

__all__ = ["PDRouter", "serve_router"]
