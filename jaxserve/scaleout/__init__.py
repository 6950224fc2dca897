"""Scale-out on Ray, an optional extra (`pip install 'jaxserve[ray]'`): one jaxserve process per host placed by a
placement group (hosts.py; `jaxserve serve --distributed-executor-backend ray`, launch.py), and data-parallel replicas
behind Ray Serve with the OpenAI routes (replicas.py). Each runs the `jaxserve serve` command whole in a child process
(child.py), so every flag, route and shutdown rule is the server's own. Ray is imported by the functions that use it,
never by this package, so `import jaxserve` and the command line work without it."""
from __future__ import annotations

RAY_EXTRA = "pip install 'jaxserve[ray]'"


def require_ray():
    """The ray module, or a RuntimeError that says how to install it (the command line prints it as one line)."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"Ray is not installed ({e}): {RAY_EXTRA}") from None
    return ray
