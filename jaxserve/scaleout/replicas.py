"""Data-parallel jaxserve replicas behind Ray Serve, with the OpenAI routes: each replica runs one `jaxserve serve`
(one engine) on a loopback port of its node and forwards every HTTP request to it as it came, the answer back as it
is written (streams included). The routes, their checks and errors are the server's own.

    serve run jaxserve.scaleout.replicas:build_app model=/models/x max-model-len=4096 num_replicas=2
    serve.run(build_app({"model": "/models/x", "num_replicas": 2}))

A replica whose server ends fails its health check and Serve replaces it; a replica lost with its requests fails
them (Serve answers a 500, or a stream breaks) while the others go on, and requests Serve had not handed it go to the
others. A stream whose server goes away mid-answer ends with an OpenAI-style error event (then [DONE]).
"""
from __future__ import annotations

import json

from jaxserve.openai.errors import ApiError
from jaxserve.scaleout import require_ray
from jaxserve.scaleout.child import ServeProcess, free_port

# Keys of build_app's arguments that configure the Serve deployment; every other key is a `jaxserve serve` flag.
DEPLOYMENT_KEYS = ("num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests", "name",
                   "start_timeout_s", "health_check_period_s", "health_check_timeout_s")
HOP_BY_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te", "upgrade",
              "proxy-connection", "proxy-authorization", "trailer"}
# Serve's own HTTP server writes these on the answer: the server's would come twice.
SERVER_WRITTEN = {"date", "server"}
REPLICA_HEADER = "x-jaxserve-replica"  # which replica answered (its Serve replica id): for logs and tests


def serve_flags(args: dict) -> list[str]:
    """build_app's other keys as `jaxserve serve` flags: {"max_model_len": 96} (or "max-model-len") ->
    --max-model-len 96; a true boolean (or "true") is a bare switch (--enable-lora), a false one is left out; a list
    gives the flag once per item. --host and --port are the replica's own."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if flag in ("--host", "--port"):
            raise ValueError(f"{key}: each replica serves on a loopback port of its own; Serve's HTTP proxy is the "
                             "address clients use (serve.start(http_options=...))")
        if value is True or (isinstance(value, str) and value.lower() == "true"):
            flags.append(flag)
        elif not (value is False or (isinstance(value, str) and value.lower() == "false")):
            flags += [x for item in (value if isinstance(value, list) else [value]) for x in (flag, str(item))]
    from jaxserve.scaleout.hosts import http_address
    http_address(flags, 1)  # checked by the server's own parser, before any replica starts
    return flags


def _json_option(value):
    """A deployment option given on `serve run`'s command line is a string: JSON there, as is from Python."""
    return json.loads(value) if isinstance(value, str) else value


class JaxserveReplica:
    """One replica: its `jaxserve serve` on a loopback port, and the forwarding of Serve's requests to it."""

    def __init__(self, flags: list[str], start_timeout_s: float = 900.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = ServeProcess([*flags, "--host", "127.0.0.1", "--port", str(self.port)], name="replica")
        try:
            self.server.wait_http(self.base + "/health", start_timeout_s)
        except RuntimeError:
            self.server.stop(5)
            raise
        self._session = None
        try:
            from ray import serve
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (a test of the class alone): no id to give
            self.replica_id = "local"

    def check_health(self) -> None:
        """Serve's health check: a replica whose server ended is replaced."""
        if self.server.returncode is not None:
            raise RuntimeError(f"jaxserve exited with code {self.server.returncode}:\n{self.server.tail()}")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(30)

    async def __call__(self, request):
        import aiohttp
        from starlette.responses import JSONResponse, StreamingResponse
        if self._session is None:  # made on the replica's own event loop
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                                  auto_decompress=False)
        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        url = self.base + path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            answer = await self._session.request(request.method, url, data=await request.body(), headers=headers)
        except aiohttp.ClientError as e:
            error = ApiError(503, f"this replica's jaxserve server is unreachable ({type(e).__name__}: {e})")
            return JSONResponse(error.body(), status_code=503, headers={REPLICA_HEADER: self.replica_id})
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP | SERVER_WRITTEN}
        return StreamingResponse(self.relay(answer), status_code=answer.status,
                                 headers={**kept, REPLICA_HEADER: self.replica_id})

    async def relay(self, answer):
        """The server's answer as it comes; a stream cut off by the server's end gets an error event and [DONE],
        so that an OpenAI client reports an error rather than a short answer."""
        import aiohttp
        try:
            async for chunk in answer.content.iter_any():
                yield chunk
        except aiohttp.ClientError as e:
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                error = ApiError(502, f"this replica's jaxserve server went away mid-stream ({type(e).__name__})")
                yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            else:
                raise
        finally:
            answer.release()


def build_app(args: dict):
    """The Serve application: `serve run jaxserve.scaleout.replicas:build_app KEY=VALUE ...` or serve.run(...).

    num_replicas (default 1; "auto" or autoscaling_config for Serve's autoscaling), autoscaling_config (Serve's, as a
    dict or JSON), ray_actor_options (each replica's resources, e.g. {"num_gpus": 1} or {"resources": {"TPU": 4}};
    its runtime_env's env_vars reach the server), max_ongoing_requests (requests Serve hands one replica at once;
    default 64: the engine batches them), name (the deployment's), start_timeout_s (how long a replica's server may
    take to load and compile; default 900), health_check_period_s and health_check_timeout_s (Serve's: how often a
    replica is asked whether its server still runs). Every other key is a `jaxserve serve` flag (serve_flags)."""
    require_ray()
    from ray import serve
    deployment = {k: _json_option(args[k]) for k in DEPLOYMENT_KEYS if k in args}
    flags = serve_flags({k: v for k, v in args.items() if k not in DEPLOYMENT_KEYS})
    options = {"num_replicas": deployment.get("num_replicas", 1),
               "max_ongoing_requests": int(deployment.get("max_ongoing_requests", 64)),
               "ray_actor_options": deployment.get("ray_actor_options") or {"num_cpus": 1},
               "name": deployment.get("name", "jaxserve")}
    if isinstance(options["num_replicas"], str) and options["num_replicas"] != "auto":
        options["num_replicas"] = int(options["num_replicas"])
    for key in ("health_check_period_s", "health_check_timeout_s"):  # Serve's own, passed through
        if key in deployment:
            options[key] = float(deployment[key])
    if "autoscaling_config" in deployment:
        options["autoscaling_config"] = deployment["autoscaling_config"]
        options.pop("num_replicas")
    timeout = float(deployment.get("start_timeout_s", 900.0))
    return serve.deployment(JaxserveReplica, **options).bind(flags, timeout)
