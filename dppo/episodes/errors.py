"""An episode's error as text (`describe_error`): what an agent, an agent service or an environment raised becomes the
error line of its episode (samples.jsonl's `<error>`, `Episode.error`), never an empty message.

    describe_error(httpx.ReadError(""))     # 'ReadError: connection to http://127.0.0.1:8100/episode closed before
                                            #  a reply (the server may have died)' (the URL from the error's request)
    describe_error(err_raised_from_cause)   # 'APIConnectionError: Connection error. (from ReadError: ...)'

Connection errors of httpx (what `openai` and the agent service client use) often carry no message at all (a
`ReadError` when the peer's process was killed mid-reply); the text then says what happened and where, from the
error's request or the `url` given. The chain of causes (`raise ... from`, else the implicit context) follows, up to
`MAX_CHAIN` links, each said once (httpx's error re-raised from httpcore's of the same name and message: once).
"""

from __future__ import annotations

MAX_CHAIN = 3
"""Causes (`__cause__`, else `__context__`) described after the error itself, at most."""


def describe_error(err: BaseException, *, url: str | None = None, peer: str = "the server") -> str:
    """`Type: message` of `err` and of its causes (`... (from Type: message)`), never an empty message: an error with
    none says so or, for a dropped connection, where and what (`url`, else the URL of the
    error's request; `peer` names who was at the other end)."""
    text, seen, link, said = _one(err, url, peer), {id(err)}, err, 0
    last = (type(err).__name__, str(err))
    while said < MAX_CHAIN:
        link = link.__cause__ if link.__cause__ is not None else (
            None if link.__suppress_context__ else link.__context__)
        if link is None or id(link) in seen:
            break
        seen.add(id(link))
        if (type(link).__name__, str(link)) == last:  # a library's wrapper of its transport's error: said already
            continue
        last, said = (type(link).__name__, str(link)), said + 1
        text += f" (from {_one(link, url, peer)})"
    return text


def _one(err: BaseException, url: str | None, peer: str) -> str:
    """One error of the chain: `Type: message`, a group's members, or what an empty message stands for."""
    name = type(err).__name__
    if isinstance(err, BaseExceptionGroup):
        return f"{name}: " + "; ".join(describe_error(e, url=url, peer=peer) for e in err.exceptions)
    message = str(err).strip()
    if message:
        return f"{name}: {message}"
    where = url or _request_url(err)
    if _is_connection_error(err):
        target = f"connection to {where}" if where else "the connection"
        return f"{name}: {target} closed before a reply ({peer} may have died)"
    return f"{name} (no message{f'; the request: {where}' if where else ''})"


def _request_url(err: BaseException) -> str | None:
    """The URL of the request an httpx error belongs to, where it has one."""
    try:
        return str(err.request.url)  # (httpx raises RuntimeError when the request is not set)
    except Exception:  # noqa: BLE001 - not an httpx error, or one without its request
        return None


def _is_connection_error(err: BaseException) -> bool:
    """A dropped or failed connection: an OS-level one, or an httpx transport error (httpx is optional)."""
    if isinstance(err, (ConnectionError, EOFError)):
        return True
    try:
        import httpx
    except ImportError:
        return False
    return isinstance(err, httpx.TransportError)


__all__ = ["MAX_CHAIN", "describe_error"]
