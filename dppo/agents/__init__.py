"""Any agent, trained with DPPO: an OpenAI-compatible recording proxy in front of the run's engine.

- `chat`: OpenAI request bodies (what is refused and why), messages to token ids, replies to OpenAI messages.
- `rows`: an episode's calls joined into token-in-token-out training rows (a new row where a call does not extend one).
- `proxy`: the HTTP endpoint (FastAPI on uvicorn), its batching of concurrent calls into engine calls, the records.
- `runner`: `AgentSpec`, the run's episodes when `agent.name` is set: P x G agents per step, each contained.
- `examples.calculator`: the calculator task as an agent that imports only the standard library (it gets its
  `openai` client from dppo).
"""
