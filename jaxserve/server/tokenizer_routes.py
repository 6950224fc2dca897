"""The routes of vLLM's tokenizer endpoints (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`) on a
Server: the model a request names, its admission, and the answer built off the event loop. What they answer is
`jaxserve.server.tokenizer_endpoints`'s."""
from __future__ import annotations

from aiohttp import web

from jaxserve.server.responses import answered_off_loop
from jaxserve.server.tokenizer_endpoints import detokenize, tokenize, tokenizer_info

# Outside /v1 (where vLLM has them), behind the API key all the same: they cost tokenizing work.
PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def add_routes(app: web.Application, server) -> None:
    """The routes on `server` (the jaxserve.server.app.Server: its models and admission)."""
    routes = TokenizerRoutes(server)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/tokenizer_info", routes.tokenizer_info)


class TokenizerRoutes:
    def __init__(self, server):
        self.server = server

    async def tokenize(self, request):
        return await self._answer(request, lambda body, m: tokenize(body, m.tokenizer, m.engine.max_model_len))

    async def detokenize(self, request):
        return await self._answer(request, lambda body, m: detokenize(body, m.tokenizer, m.engine.vocab_size))

    async def _answer(self, request, answer):
        s = self.server
        body = await s._body(request)
        m, _ = s._target(body)
        # A 1 MiB prompt takes a while, and its answer (500,000 ids, their strings) too: off the event loop, within
        # the capacity.
        with s._admitted(m, 1):
            return await answered_off_loop(m, answer, body, m)

    async def tokenizer_info(self, request):
        m, _ = self.server._target({"model": request.query["model"]} if "model" in request.query else {})
        return web.json_response(tokenizer_info(m.tokenizer, m.engine.max_model_len))
