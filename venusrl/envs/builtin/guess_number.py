"""Guess the number: a small, genuinely multi-turn tool task that a tiny model can learn on a CPU.

The sandbox holds a secret integer in [1, N] (set by the task's setup; the prompt never shows it).
The model calls `guess(n)` and reads "higher", "lower" or "correct"; it has MAX_GUESSES guesses.
With N = 63 = 2**6 - 1 and 6 guesses, only binary search wins every time (it needs all 6 for 32
secrets, and at least 3 for 60 of the 63), so success means reading and using the observations:
a policy that ignores them wins with probability 6 / 63 = 10 %, one that guesses anywhere inside
the known interval about 49 %. Reward: 1 when a guess was correct, else 0. The episode ends with
the game: at the correct guess or at the last one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from venusrl.envs.environment import Environment, SandboxVerbs, Task, Tool
from venusrl.envs.types import MiB, TemplateSpec
from venusrl.model.tool_calls import RESPONSE_OPEN, format_tool_call

N = 63
MAX_GUESSES = 6

# Runs in the sandbox's interpreter. The model has no code tool here, so it cannot read `secret`.
_SETUP = f"""
N = {N}
MAX_GUESSES = {MAX_GUESSES}
secret = None  # the task's setup sets it
guesses = 0
solved = False
low, high = 1, N


def guess(n):
    global guesses, solved, low, high
    if not 1 <= n <= N:
        raise ValueError(f"n must be between 1 and {{N}}, got {{n}}")
    if guesses >= MAX_GUESSES:
        raise ValueError(f"out of guesses: all {{MAX_GUESSES}} are used")
    guesses += 1
    # The answer restates what is known so far: a tiny model then needs only the last
    # observation, not the whole history (MEASURED.md: learnable on a CPU that way).
    if n < secret:
        low = max(low, n + 1)
        return f"higher: the number is between {{low}} and {{high}}"
    if n > secret:
        high = min(high, n - 1)
        return f"lower: the number is between {{low}} and {{high}}"
    solved = True
    return f"correct: the number is {{n}}"
"""

_PROMPT = (
    f"I am thinking of an integer between 1 and {N}. Find it with the guess tool, which answers"
    f" higher, lower or correct. You have {MAX_GUESSES} guesses."
)


class GuessNumber(Environment):
    name = "guess_number"
    template = TemplateSpec(name="guess-number", setup=_SETUP, declared_memory_bytes=256 * MiB)
    instructions = "You are a helpful assistant that solves tasks by calling tools."
    tools = (
        Tool(
            "guess",
            f"Guess the secret integer. Answers higher, lower or correct. {MAX_GUESSES} guesses.",
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "description": f"from 1 to {N}"}},
                "required": ["n"],
            },
        ),
    )
    max_turns = MAX_GUESSES + 2  # every guess in its own turn, and slack for calls that fail

    def __init__(self, task: Task, sandbox: SandboxVerbs) -> None:
        super().__init__(task, sandbox)
        self.guesses_left = MAX_GUESSES

    def ended(self, answers: list[str]) -> bool:
        """The game is over, won or out of guesses: nothing the model does next can change the
        reward. (The answers are the sandbox's own text, never the model's.) Turns after a win
        would teach nothing but get reinforced with it: trained on, policies learnt to go on
        calling the tool after the correct guess."""
        self.guesses_left -= sum(a.startswith(("higher:", "lower:", "correct:")) for a in answers)
        return self.guesses_left <= 0 or any(a.startswith("correct:") for a in answers)

    @classmethod
    def tasks(cls, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        index = 0
        while True:
            secret = rng.randint(1, N)
            yield Task(id=f"guess-{seed}-{index}", prompt=_PROMPT, setup=f"secret = {secret}")
            index += 1

    @classmethod
    def demonstrator(cls, task: Task, seed: int) -> BinarySearchExpert:
        """The warm start imitates binary search. A short imitation leaves a policy that samples
        the midpoint most of the time, not always (35-50 % of its episodes win): RL's part is to
        make it reliable. Poorer demonstrations (random guesses mixed in) were tried and left
        GRPO no usable signal: their wins were luck (BENCHMARKS.md)."""
        return BinarySearchExpert()

    async def reward(self) -> float:
        return await self.flag_reward("solved")


def _guess_call(n: int) -> str:
    return format_tool_call("guess", {"n": n})


class BinarySearchExpert:
    """A scripted policy that wins by reading each observation: call it with the prompt, then with
    each observation; it returns the next turn's text."""

    def __init__(self) -> None:
        self.low, self.high = 1, N
        self.last_guess: int | None = None
        self.guesses = 0

    def __call__(self, observation: str) -> str:
        if self.last_guess is not None:
            reply = observation.removeprefix(f"{RESPONSE_OPEN}\n")
            if reply.startswith("higher"):
                self.low = max(self.low, self.last_guess + 1)
            elif reply.startswith("lower"):
                self.high = min(self.high, self.last_guess - 1)
            else:
                raise ValueError(f"unexpected observation: {observation!r}")
            if self.low > self.high:
                raise ValueError("the observations contradict each other")
        self.last_guess = (self.low + self.high) // 2
        self.guesses += 1
        return _guess_call(self.last_guess)


class RandomGuesser:
    """A policy that ignores the observations: MAX_GUESSES distinct random guesses.
    It plays the way an untrained model does and wins only by luck."""

    def __init__(self, seed: int) -> None:
        self.guesses = random.Random(seed).sample(range(1, N + 1), MAX_GUESSES)

    def __call__(self, observation: str) -> str:
        return _guess_call(self.guesses.pop()) if self.guesses else "I give up."
