"""Episodes, token in, token out: every rollout a `RolloutSource` returns is an episode of the run's episode kind.

    settings = EPISODE_KINDS[kind](...)                 # the run config's section of that kind (single: none)
    task = settings.task(size=..., eval_size=..., seed=...)   # the kind's own examples (verifiers), else None
    episodes = settings.episodes(max_new_tokens=..., reward=..., model=..., proxy=...)   # picklable: workers get it
    rollouts = episodes.collector()(engine, examples, params)   # params.n episodes per example, prompt-major
    episodes.score(examples, rollouts)                  # in the trainer's process: every reward set
    rewards, stats = episode_rewards(rollouts)          # what the trainer and the evaluation read
    episodes.metrics(rollouts)                          # the step's episode/* metrics

- `settings`: `SingleSettings`, `EnvSettings` (the `env` section), `AgentSettings` (the `agent` section),
  `VerifiersSettings` (the `verifiers` section), `ProxySettings` (the `proxy` section: the recording proxy of every
  kind that `uses_proxy`, agent and verifiers) and the `EPISODE_KINDS` registry; each kind's episodes' `max_turns`
  bounds the loss's per-turn units.
- The drivers, one per kind: `single` (a single answer, one engine call and one reward call per batch),
  `env_loop` (an environment's turns, scored by it), `agent_loop` (an agent's OpenAI client calls through the
  recording proxy; a verifiers taskset's harness too, `verifiers`, which also supplies the run's examples).
- `records`: the token recorder (generated tokens with µ, µ's top-K cells, versions, turns; inserted tokens with
  mask 0) every multi-turn episode fills and turns into a `Rollout`.
- `chat`: the chat codec (messages to ids, the ids appended messages add, tool calls, replies, transcripts), used
  by the environment loop and by the proxy's join rule alike.
- The agent proxy: `proxy` (the FastAPI app), `proxy_requests` (what a request may ask), `proxy_batching` (the
  engine side), `agent_rows` (calls joined into rows).
- `results`: episodes among rows, rewards, success, and the one episode-metrics function.
- `examples.calculator`: the calculator task as an agent that imports only the standard library.
"""
