"""A small OpenEnv environment and its server app, written with openenv's own server classes, for the adapter's tests
(`dppo.envs.openenv`): guess the number.

    reset(seed=None, target=None, max_attempts=3)  -> "Guess the number from 0 to 9."
    step({"guess": "7"})                            -> "higher" / "lower" (reward 0.1: a number was guessed),
                                                       "correct" (reward 1, done); done after max_attempts too

A guess with no number is answered "not a number" (reward 0); a guess longer than 40 characters is refused by the
server's validation (the action's schema); the guess "crash" makes the environment raise in the server (an
execution error); reset(die_on_step=True) makes the server's process exit at the next step (a server that dies
mid-episode: only for a server in a process of its own). `app` is the server (`uvicorn tests.envs.openenv_game:app`, or
dppo's `app` option); GET /sessions counts the sessions it opened and closed. `broken_app` fails at startup.
"""

from __future__ import annotations

import os
import random
import re
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class GuessAction(Action):
    guess: str = Field(..., max_length=40, description="Your guess: a whole number from 0 to 9")


class GuessObservation(Observation):
    message: str = ""
    attempts: int = 0


COUNTS = {"opened": 0, "closed": 0}
_LOCK = threading.Lock()


class GuessGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.target, self.attempts, self.max_attempts, self.episode_id, self.die = 0, 0, 3, None, False
        with _LOCK:
            COUNTS["opened"] += 1

    def reset(self, seed=None, episode_id=None, target=None, max_attempts: int = 3, die_on_step: bool = False,
              **kwargs) -> GuessObservation:
        self.target = int(target) if target is not None else random.Random(seed).randint(0, 9)
        self.attempts, self.max_attempts, self.episode_id, self.die = 0, int(max_attempts), episode_id, die_on_step
        return GuessObservation(message="Guess the number from 0 to 9.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if self.die:
            os._exit(1)
        if action.guess == "crash":
            raise RuntimeError("the game broke")
        self.attempts += 1
        numbers = re.findall(r"\d+", action.guess)
        if not numbers:
            message, reward = "not a number", 0.0
        else:
            guess = int(numbers[-1])
            message = "correct" if guess == self.target else ("higher" if guess < self.target else "lower")
            reward = 1.0 if guess == self.target else 0.1
        done = message == "correct" or self.attempts >= self.max_attempts
        return GuessObservation(message=message, attempts=self.attempts, reward=reward, done=done)

    @property
    def state(self) -> State:
        return State(episode_id=self.episode_id, step_count=self.attempts)

    def close(self) -> None:
        with _LOCK:
            COUNTS["closed"] += 1


app = create_app(GuessGame, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)


@app.get("/sessions")
def sessions() -> dict:
    with _LOCK:
        return dict(COUNTS)


@asynccontextmanager
async def _fails(app):
    raise RuntimeError("this app cannot start")
    yield


broken_app = FastAPI(lifespan=_fails)
