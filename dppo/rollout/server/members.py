"""The servers of one `vllm-server` engine as members that fail and come back (`ServerGroup`), so a run goes on when one
dies (docs/engines.md, "Faults").

A member is `up` (it takes requests and weight syncs), `down` (it failed: dppo is restarting it, or, for a server
the user attached, asking it for `/health` until it answers) or `gone` (dppo started it and it has used its
`restarts`). A failure is what `ServerDown` reports: the connection refused or reset, a request past its timeout,
a 5xx from a server that then fails its health check. On a failure (`fail`):
- a server dppo started is stopped (its whole group, `ServerProcess.stop`) and started again in the background on a
  new port, up to `restarts` times per server in the run (a start that fails counts; then it is `gone`); once healthy it rejoins through `join`, which loads
  the current weights under the engine's sync lock (`sync`), so it never serves a stale version and no weight sync
  passes it by;
- a server the user attached (`rollout.vllm_server.urls`) is left out until it answers `/health` again, then rejoins
  the same way.
Requests pick the `up` member with the fewest outstanding requests (`pick`); with none up they wait up to
`timeout_s` for one to rejoin, and when none can come back (all gone) the error of the last failure ends the step,
as it did before restarts existed. Every failure, restart and rejoin is printed (`[dppo] server-0 ...`), appended to
`events.jsonl` beside the servers' logs and counted (`metrics`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dppo.rollout.server.client import ServerClient
from dppo.rollout.server.launch import ServerError, ServerProcess

PROBE_S = 2.0
"""How often a down attached server is asked for `/health`."""


@dataclass
class Member:
    """One server of the engine."""

    name: str
    client: ServerClient
    process: ServerProcess | None = None
    """The process dppo started (None: a server the user attached)."""
    state: str = "up"
    restarts: int = 0
    """Restarts so far in the run (a start that fails counts)."""
    error: str = ""
    """Why it last failed."""

    def describe(self) -> str:
        if self.process is None:
            return f"{self.name} ({self.client.url})"
        return f"{self.name} ({self.client.url}, log {self.process.log})"


@dataclass
class ServerGroup:
    """The engine's members, their failures and returns (see the module docstring). join(member, client): attach
    `client` (a restarted or answering server) and load the current weights into it, called with `sync` held."""

    members: list[Member]
    join: Callable[[Member, ServerClient], None]
    restarts: int = 3
    timeout_s: float = 600.0
    events_path: Path | None = None
    sync: threading.RLock = field(default_factory=threading.RLock)
    """Held by the engine around a weight sync, and by a rejoin (the two never interleave)."""
    counts: dict[str, float] = field(default_factory=lambda: {"failures": 0.0, "restarts": 0.0, "rejoins": 0.0,
                                                               "retried_requests": 0.0})

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self.sync)
        self._closed = False
        self._threads: list[threading.Thread] = []

    def up(self) -> list[Member]:
        with self.sync:
            return [m for m in self.members if m.state == "up"]

    def pick(self) -> Member:
        """The up member with the fewest outstanding requests; waits for one to rejoin when none is up."""
        deadline = time.monotonic() + self.timeout_s
        with self._changed:
            while True:
                up = [m for m in self.members if m.state == "up"]
                if up:
                    return min(up, key=lambda m: m.client.outstanding)
                if self._closed:
                    raise ValueError("engine: closed")
                if all(m.state == "gone" for m in self.members) or time.monotonic() > deadline:
                    raise ServerError(self._last_error())
                self._changed.wait(min(1.0, max(0.01, deadline - time.monotonic())))

    def fail(self, member: Member, client: ServerClient, error: BaseException) -> None:
        """`member` failed with `error` on `client` (its server then). Once per failure: a member already down is
        left to its recovery, and an error of a server the member no longer is (a request sent before a restart)
        changes nothing."""
        with self._changed:
            if member.state != "up" or client is not member.client or self._closed:
                return
            member.state, member.error = "down", str(error)
            self.counts["failures"] += 1
            self._changed.notify_all()
        if member.process is not None and member.process.exited() is not None:
            member.error = f"{error}\n{member.process.describe_exit()}"
        if member.process is not None and member.restarts >= self.restarts:
            member.process.stop()
            self._set(member, "gone")
            self._event(member, "failed", f"not restarted (restarted {member.restarts} of "
                                          f"rollout.vllm_server.restarts {self.restarts} times): {_first(error)}")
            return
        plan = "restarting it" if member.process is not None else "left out until it answers /health"
        self._event(member, "failed", f"{_first(error)}; {plan}")
        target = self._restart if member.process is not None else self._probe
        thread = threading.Thread(target=target, args=(member,), daemon=True, name=f"dppo-{member.name}-recovery")
        self._threads.append(thread)
        thread.start()

    def retried(self) -> None:
        """Count a request sent again after its server failed."""
        with self.sync:
            self.counts["retried_requests"] += 1

    def metrics(self) -> dict[str, float]:
        """The counts so far and the members up now, under `server/`."""
        with self.sync:
            return {**{f"server/{k}": v for k, v in self.counts.items()},
                    "server/up": float(sum(m.state == "up" for m in self.members))}

    def close(self) -> None:
        """Stop recovering: a restart under way stops its new process; members' clients are closed."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for thread in self._threads:  # (a start under way ends at its next health check)
            thread.join(timeout=15.0)
        for member in self.members:
            if member.process is not None:
                member.process.stop()
            member.client.close()

    # --- recovery (background threads) --------------------------------------------------------------------------

    def _restart(self, member: Member) -> None:
        old = member.process
        old.stop()
        while member.restarts < self.restarts and not self._closed:
            member.restarts += 1
            with self.sync:
                self.counts["restarts"] += 1
            self._event(member, "restarting", f"restart {member.restarts} of {self.restarts}")
            try:
                proc = ServerProcess(old.settings, name=member.name, log_dir=old.log.parent)
            except ServerError as e:
                member.error = str(e)
                continue
            client = ServerClient(proc.url, name=f"{member.name} ({proc.url}, log {proc.log})",
                                  timeout_s=member.client.timeout_s, api_key=member.client.api_key)
            member.process = proc
            try:
                proc.wait_healthy(self.timeout_s, lambda: self._closed or client.healthy())
                if self._closed:
                    break
                self._rejoin(member, client)
                return
            except ServerError as e:
                member.error = str(e)
                proc.stop()
                client.close()
                self._event(member, "restart failed", _first(e))
        if member.process is not None:
            member.process.stop()
        self._set(member, "gone")
        if not self._closed:
            self._event(member, "gone", f"failed {member.restarts} restart(s); left out")

    def _probe(self, member: Member) -> None:
        while not self._closed:
            time.sleep(PROBE_S)
            if member.client.healthy():
                try:
                    self._rejoin(member, member.client)
                    return
                except ServerError as e:
                    member.error = str(e)

    def _rejoin(self, member: Member, client: ServerClient) -> None:
        with self._changed:
            if self._closed:
                return
            self.join(member, client)
            if client is not member.client:
                member.client.close()
            member.client, member.state = client, "up"
            self.counts["rejoins"] += 1
            self._changed.notify_all()
        self._event(member, "rejoined", "serving the current weights")

    def _set(self, member: Member, state: str) -> None:
        with self._changed:
            member.state = state
            self._changed.notify_all()

    def _last_error(self) -> str:
        failed = [m for m in self.members if m.error]
        if not failed:
            return f"no server answered within {self.timeout_s:g} s (rollout.vllm_server.timeout_s)"
        return "; ".join(m.error for m in failed)

    def _event(self, member: Member, what: str, detail: str) -> None:
        print(f"[dppo] {member.describe()}: {what}: {detail}", file=sys.stderr, flush=True)
        if self.events_path is None:
            return
        row = {"time": time.time(), "server": member.name, "url": member.client.url, "event": what, "detail": detail}
        try:
            with open(self.events_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError:
            pass


def _first(error: BaseException | str) -> str:
    """An error's first line (the server's log tail follows in the full message)."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__
