"""An episode's error line (`dppo.episodes.errors.describe_error`) is never `Type: ` with nothing after it: an httpx
error without a message (a killed service's `ReadError`) says where the connection dropped; a chained error names
its causes; and an agent that raises such an error gets that line as its episode's error."""

from __future__ import annotations

import httpx
import pytest

from dppo.episodes.errors import describe_error
from dppo.episodes.results import first_rows
from dppo.episodes.settings import AgentSettings, ProxySettings
from dppo.rollout.hf import HFEngine
from test_agent_loop import EXAMPLES, model, params  # noqa: F401 - `model` is a fixture

URL = "http://127.0.0.1:8100/episode"


def test_an_httpx_error_without_a_message_says_what_happened_and_where():
    assert str(httpx.ReadError("")) == ""  # (what the episode line read: "ReadError: ")
    assert describe_error(httpx.ReadError("")) == ("ReadError: the connection closed before a reply (the server may "
                                                   "have died)")
    err = httpx.ReadError("", request=httpx.Request("POST", URL))
    assert describe_error(err) == f"ReadError: connection to {URL} closed before a reply (the server may have died)"
    assert describe_error(httpx.ReadError(""), url=URL, peer="the agent service") == (
        f"ReadError: connection to {URL} closed before a reply (the agent service may have died)")
    assert describe_error(ConnectionResetError()) == ("ConnectionResetError: the connection closed before a reply "
                                                      "(the server may have died)")


def test_a_chained_error_names_its_causes():
    def agent():
        try:
            raise httpx.ReadError("", request=httpx.Request("POST", URL))
        except httpx.ReadError as err:
            raise RuntimeError("Connection error.") from err

    with pytest.raises(RuntimeError) as caught:
        agent()
    assert describe_error(caught.value) == (f"RuntimeError: Connection error. (from ReadError: connection to {URL} "
                                            f"closed before a reply (the server may have died))")
    class ReadError(Exception):  # (httpcore's, which httpx re-raises as its own of the same name and message)
        pass

    wrapped = httpx.ReadError("")
    wrapped.__cause__ = ReadError("")
    assert describe_error(wrapped, url=URL) == (f"ReadError: connection to {URL} closed before a reply (the server "
                                                f"may have died)")
    try:  # an implicit context counts too, unless suppressed (`from None`)
        try:
            {}["key"]
        except KeyError:
            raise ValueError("no key")
    except ValueError as err:
        assert describe_error(err) == "ValueError: no key (from KeyError: 'key')"
    try:
        try:
            {}["key"]
        except KeyError:
            raise ValueError("no key") from None
    except ValueError as err:
        assert describe_error(err) == "ValueError: no key"


def test_other_errors_read_as_before_or_say_they_have_no_message():
    assert describe_error(ValueError("boom")) == "ValueError: boom"
    assert describe_error(TimeoutError()) == "TimeoutError (no message)"
    group = ExceptionGroup("tasks", [ValueError("a"), httpx.ReadError("")])
    assert describe_error(group) == ("ExceptionGroup: ValueError: a; ReadError: the connection closed before a reply "
                                     "(the server may have died)")
    looped = ValueError("loop")
    looped.__cause__ = RuntimeError("back")
    looped.__cause__.__cause__ = looped  # (a cycle ends the chain)
    assert describe_error(looped) == "ValueError: loop (from RuntimeError: back)"


def test_an_agent_that_raises_an_error_without_a_message_gets_an_informative_episode_error(tmp_path, model, tokenizer):
    agent = tmp_path / "agent.py"
    agent.write_text("import httpx\n\n\ndef solve(client, example):\n"
                     "    raise httpx.ReadError('', request=httpx.Request('POST', 'http://127.0.0.1:9/run'))\n")
    collector = AgentSettings(name=f"{agent}:solve").episodes(max_new_tokens=8,
                                                              proxy=ProxySettings(max_tokens=64)).collector()
    try:
        episodes = first_rows(collector(HFEngine(model, tokenizer), EXAMPLES, params(n=1)))
    finally:
        collector.close()
    assert [r.episode.error for r in episodes] == [
        f"agent '{agent}:solve': ReadError: connection to http://127.0.0.1:9/run closed before a reply (the server "
        f"may have died)"] * 2
