"""HTTP to one vLLM server (`ServerClient`) and the reading of its token-in-token-out answers (`parse_choice`).

Requests go through `httpx` (one pooled client per server, safe across threads). Every failure is a `ServerError`
naming the server, the route and the cause: a connection refused or reset (the server died), a status other than
200 with the server's own error text, a request past its timeout (counted in `timeouts`). The server's own failures
(connection refused or reset, timeout, a 5xx while `/health` fails) are `ServerDown`: the engine retries the
request elsewhere and recovers the server (`dppo.rollout.server.members`); a request the server refuses is not.

`parse_choice` turns one choice of ``/inference/v1/generate`` into tensors: the response ids, log µ of each token
(the sampled distribution's, the server runs with ``--logprobs-mode processed_logprobs``), µ's top-K (ids and
log-probs in rank order) and the weight-version label of each token (from the choice's version spans).
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import torch
from torch import Tensor

from dppo.rollout.server.launch import ServerDown, ServerError


class ServerClient:
    """One server at `url`; `name` is how errors call it. timeout_s: the longest a request may take."""

    def __init__(self, url: str, *, name: str, timeout_s: float, api_key: str | None = None) -> None:
        self.url, self.name, self.timeout_s, self.api_key = url.rstrip("/"), name, timeout_s, api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers,
                                  limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.outstanding = 0
        """Requests sent and not yet answered (the load balancer picks the server with the fewest)."""
        self.timeouts = 0
        self._lock = threading.Lock()

    def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                timeout_s: float | None = None) -> dict:
        try:
            response = self._http.request(method, path, json=json, params=params,
                                          timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.TimeoutException as e:
            with self._lock:
                self.timeouts += 1
            raise ServerDown(f"{self.name} ({self.url}): {path} took longer than its timeout "
                             f"({timeout_s or self.timeout_s:g} s, rollout.vllm_server.timeout_s)") from e
        except httpx.TransportError as e:
            raise ServerDown(f"{self.name} ({self.url}): {path} failed: {type(e).__name__}: {e} "
                             f"(is the server running?)") from e
        if response.status_code != 200:
            # a 5xx from a server that no longer passes its health check: the server failed, not the request
            error = ServerDown if response.status_code >= 500 and not self.healthy() else ServerError
            raise error(f"{self.name} ({self.url}): {path} answered {response.status_code}: {response.text[:2000]}")
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError:  # some routes answer plain text (load_lora_adapter)
            return {"text": response.text}

    def track(self, delta: int) -> None:
        """Count a generate request as sent (+1) or answered (-1)."""
        with self._lock:
            self.outstanding += delta

    def post(self, path: str, json: Any = None, **kw) -> dict:
        return self.request("POST", path, json=json, **kw)

    def get(self, path: str, **kw) -> dict:
        return self.request("GET", path, **kw)

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()


def parse_choice(choice: dict, k: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, list[tuple[str, int]]]:
    """(response ids [T], log µ [T], top-K ids [T, K] or None, top-K log-probs [T, K] or None, version spans
    [(label, end)]) of one generate choice requested with ``logprobs = K + 1`` (K = `k`; 0: the sampled token only).

    The endpoint lists, per token, the sampled token first and then the best other tokens by rank, cut at K + 1
    entries: the K best of those entries by log-prob are µ's top-K (the sampled token is either one of them or the
    one extra entry)."""
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise RuntimeError(f"the server returned log-probs for {len(content)} of {len(ids)} tokens")
    logp = torch.tensor([c["logprob"] for c in content], dtype=torch.float32)
    if any(c["token_id"] != t for c, t in zip(content, ids)):
        raise RuntimeError("the server's log-prob entries do not follow the sampled tokens")
    top_ids = top_logp = None
    if k:
        rows_ids, rows_lp = [], []
        for t, c in enumerate(content):
            seen: dict[int, float] = {}
            for e in c.get("top_logprobs") or []:
                seen.setdefault(int(e["token_id"]), float(e["logprob"]))
            if len(seen) < k:
                raise RuntimeError(f"token {t}: the server returned {len(seen)} of µ's top-{k} (is the server's "
                                   f"--max-logprobs below {k + 1}?)")
            best = sorted(seen.items(), key=lambda item: -item[1])[:k]  # stable: ties keep the server's rank order
            rows_ids.append([i for i, _ in best])
            rows_lp.append([lp for _, lp in best])
        top_ids = torch.tensor(rows_ids, dtype=torch.long).view(len(ids), k)
        top_logp = torch.tensor(rows_lp, dtype=torch.float32).view(len(ids), k)
    spans = [(s["version"], int(s["end"])) for s in choice.get("weight_versions") or []]
    return torch.tensor(ids, dtype=torch.long), logp, top_ids, top_logp, spans
