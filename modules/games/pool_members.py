"""The pool's members answering and judging (:class:`~alignment_games.modules.pool.StackelbergPool`, phases 3, 4).

The players of one policy bank answer, and judge, in one batch, each row with its own player's adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from alignment_games.modules.lm.policy_bank import PolicyBank
from alignment_games.modules.lm.rollout import Rollout
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.peer_judges import PeerJudging, judge_prompts, member_scores, peer_scores_each


class PoolMembers:
    """Mixin of :class:`alignment_games.modules.pool.StackelbergPool`: its members' prompts, answers and judgements."""

    banks: Sequence[PolicyBank]  # the pool's attributes used here, and hparams.system_prompt
    _bank_of: dict[str, int]  # each player's bank index
    sampling: Sampling
    judging: PeerJudging

    def bank(self, player: str) -> PolicyBank:
        """The :class:`PolicyBank` holding ``player``."""
        return self.banks[self._bank_of[player]]

    def banks_of(self, players: list[str]) -> list[tuple[PolicyBank, list[str]]]:
        """``players`` grouped by the bank holding them (in order), so that each bank decodes its players together."""
        order = list(dict.fromkeys(self._bank_of[p] for p in players))
        return [(self.banks[i], [p for p in players if self._bank_of[p] == i]) for i in order]

    def chat(self, player: str, user: str, system: str | None = None) -> str:
        """``player``'s chat-formatted prompt (each model its own template)."""
        return self.bank(player).chat(system, user)

    def respond(self, player: str, instructions: list[str], n: int) -> Rollout:
        """``n`` sampled responses per instruction (rows ``i*n + s``), temperature and top-p of the config."""
        return self.respond_all({player: instructions}, n)[player]

    def respond_all(self, instructions: dict[str, list[str]], n: int) -> dict[str, Rollout]:
        """:meth:`respond` of each player to its instructions; each rollout shaped as the player's own decode."""
        system, out = self.hparams.system_prompt, {}
        for bank, players in self.banks_of(list(instructions)):
            requests = [(p, [self.chat(p, x, system) for x in instructions[p]]) for p in players]
            out.update(zip(players, bank.generate_each(requests, n, self.sampling)))
        return out

    def judge(
        self, judge: str, instructions: list[str], responses: list[str], references: list[str | None] | None = None
    ) -> list[tuple[float, bool]]:
        """Scores in [1, 10] of ``judge`` for each (instruction, response), with whether each was read."""
        return self.judge_all({judge: (instructions, responses, references)})[judge]

    def judge_all(self, asked: dict[str, tuple[list[str], list[str], list[str | None] | None]]) -> dict[str, list]:
        """:meth:`judge` of each judge's ``(instructions, responses, references)``; generated ones a bank at a time."""
        j, system, out = self.judging, self.hparams.system_prompt, {}
        if j.mode != "generate":
            for name, (xs, ys, refs) in asked.items():
                out[name] = member_scores(self.bank(name), name, partial(self.chat, name), xs, ys, j, system, refs)
            return out
        for bank, players in self.banks_of(list(asked)):
            requests = [(p, judge_prompts(bank, partial(self.chat, p), asked[p][0], asked[p][1], j)) for p in players]
            out.update(zip(players, peer_scores_each(bank, requests, j)))
        return out
