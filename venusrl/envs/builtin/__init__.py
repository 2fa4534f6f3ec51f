"""Environments that ship with venusrl, by name: small tasks to learn on and to test with."""

from venusrl.envs.builtin.agent_workload import AgentWorkload
from venusrl.envs.builtin.guess_number import GuessNumber
from venusrl.envs.builtin.math_python import MathPython
from venusrl.envs.builtin.swe import Swe
from venusrl.envs.builtin.swe_mini import SweMini
from venusrl.envs.builtin.treasure_hunt import TreasureHunt
from venusrl.envs.environment import Environment

BUILTIN: dict[str, type[Environment]] = {
    env.name: env for env in (TreasureHunt, GuessNumber, SweMini, Swe, MathPython, AgentWorkload)
}
