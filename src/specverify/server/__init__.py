"""`specverify serve`: an OpenAI-compatible HTTP server with live speculation metrics."""

__all__ = ["SpecverifyServer", "create_app"]


def __getattr__(name: str):
    # FastAPI and uvicorn load only when the server is used, so other subcommands start fast.
    if name in __all__:
        from specverify.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'specverify.server' has no attribute {name!r}")
