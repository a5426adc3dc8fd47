"""Tabular SMIDA (Algorithm 1) as a LightningModule: one iteration per training step, logged against Theorem C.1.

The game is read from a ``.pt`` file or drawn by :func:`alignment_games.modules.algorithms.tabular_games.random_game`;
each step applies one exact update to the iterate held in buffers (a resume continues bit for bit). Logged every step
for the iterate ``(π_t, ω_t)`` the step starts from::

    leader/kl, leader/kl_reverse      KL_ρ(π_t ‖ π*), KL_ρ(π* ‖ π_t); leader/kl_max: max_x of both
    follower/kl, follower/kl_reverse  KL_{ρ,π*}(ω_t ‖ ω*) and reverse; follower/kl_max: max_{x,y} of both
    leader/kl_bound(_simple), follower/kl_bound   Theorem C.1, eqs. (14), (15), (13)
    follower/utility  E_{ρ,π_t,ω_t}[u];  game/value  f(π_t, ω_t) (eq. 4);  game/value_gap  f(π_t, ω_t) − f(π*, ω*)

The bounds hold for ``*_kl_max`` and hence for the ρ-averages (Theorem 4.3).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from torch import Tensor
from typing_extensions import override

from alignment_games.callbacks.fault_tolerance import atomic_torch_save
from alignment_games.modules.algorithms.stackelberg import (
    SMIDAStep,
    StepSizes,
    check_step_sizes,
    game_value,
    kl_both,
    kl_bound_at,
    kl_bound_start,
    log_normalise,
    stackelberg_equilibrium,
)
from alignment_games.modules.algorithms.tabular_games import GAME_KEYS, load_game, random_game
from alignment_games.modules.checkpoints.trust import CheckpointLoading, check_checkpoint_matches, stamp_family
from alignment_games.modules.evaluation.audit import run_provenance
from alignment_games.modules.training.faults import NonFiniteGuard


class TabularSMIDA(CheckpointLoading, NonFiniteGuard, L.LightningModule):
    """Stackelberg Mirror Descent–Ascent on a tabular game, one iteration of Algorithm 1 per training step.

    No gradient and no optimizer: ``training_step`` applies the exact update and steps Lightning's placeholder
    optimizer, so that ``trainer.global_step`` (``max_steps``, checkpoint names) counts SMIDA iterations.

    Args:
        game_path: A ``.pt`` file with ``u``, ``pi_ref``, ``omega_ref`` and optionally ``rho`` (:func:`load_game`).
        num_contexts: Random game: number of contexts ``X``.
        num_actions: Random game: number of actions ``Y`` (shared by both players).
        ensemble_size: Random game: members of the random preference ensemble.
        utility: Random game: ``"variance"`` (App. E.4), ``"decision_uncertainty"``, ``"jsd"`` or ``"slhf"`` (App. F).
        reference: Random game: ``"random"`` or ``"uniform"`` reference policies.
        seed: Random game: seed of the game (the iterates themselves are deterministic).
        tau_leader: Leader's KL weight ``τ_L > 0``.
        tau_follower: Follower's KL weight ``τ_F > 0``.
        eta_leader: Leader's step size ``η_L``; condition (6): ``0 < η_L τ_L < η_F τ_F``.
        eta_follower: Follower's step size ``η_F``; condition (6): ``η_F τ_F ≤ 1``.
        dtype: Floating dtype of the game and the iterates; float64 resolves KL down to about 1e-16.
        max_consecutive_nonfinite: Stop after this many NaN or ``+inf`` iterates in a row (each skipped, not applied).

    Raises:
        ValueError: step sizes breaking condition (6), or a malformed game.
    """

    #: log-probabilities, whose ``-inf`` (a zero probability) a checkpoint read back may hold (NaN and +inf refused)
    minus_inf_allowed = ("log_pi", "log_omega", "log_pi_ref", "log_omega_ref")

    def __init__(
        self,
        game_path: str | None = None,
        num_contexts: int = 16,
        num_actions: int = 8,
        ensemble_size: int = 5,
        utility: Literal["variance", "decision_uncertainty", "jsd", "slhf"] = "variance",
        reference: Literal["random", "uniform"] = "random",
        seed: int = 0,
        tau_leader: float = 0.05,
        tau_follower: float = 0.05,
        eta_leader: float = 1.0,
        eta_follower: float = 10.0,
        dtype: Literal["float64", "float32"] = "float64",
        max_consecutive_nonfinite: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.init_nonfinite_guard(max_consecutive_nonfinite)
        check_step_sizes(tau_leader, tau_follower, eta_leader, eta_follower)
        sizes = {"num_contexts": num_contexts, "num_actions": num_actions, "ensemble_size": ensemble_size}
        for name, value in sizes.items() if game_path is None else ():  # a loaded game brings its own sizes
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        torch_dtype = {"float64": torch.float64, "float32": torch.float32}[dtype]
        drawn = (num_contexts, num_actions, ensemble_size, utility, reference, seed, torch_dtype)
        game = load_game(game_path) if game_path is not None else random_game(*drawn)
        u, pi_ref, omega_ref = (game[k].to(torch_dtype) for k in GAME_KEYS)
        log_pi_star, log_omega_star = stackelberg_equilibrium(
            u, pi_ref, omega_ref, tau_leader, tau_follower, log_space=True
        )
        x, rho = u.shape[0], game.get("rho")
        rho = torch.full((x,), 1.0 / x, dtype=torch_dtype) if rho is None else rho.to(torch_dtype)
        if tuple(rho.shape) != (x,) or not (rho > 0).all() or abs(float(rho.sum()) - 1.0) > 1e-5:
            raise ValueError(
                f"rho must be a full-support distribution over the {x} contexts, got shape {list(rho.shape)}"
            )

        # The game (persistent: a checkpoint is self-contained and a resume onto another game is caught).
        self.register_buffer("u", u)
        self.register_buffer("log_pi_ref", log_normalise(pi_ref.log()))
        self.register_buffer("log_omega_ref", log_normalise(omega_ref.log()))
        self.register_buffer("rho", rho / rho.sum())
        # The equilibrium is a function of the game: recomputed, not stored.
        self.register_buffer("log_pi_star", log_pi_star, persistent=False)
        self.register_buffer("log_omega_star", log_omega_star, persistent=False)
        # The iterate of Algorithm 1, started at the references, and its iteration count t.
        self.register_buffer("log_pi", self.log_pi_ref.clone())
        self.register_buffer("log_omega", self.log_omega_ref.clone())
        self.register_buffer("iteration", torch.zeros((), dtype=torch.long))

        self._step_sizes = StepSizes(tau_leader, tau_follower, eta_leader, eta_follower)
        self._bound_start = kl_bound_start(u, pi_ref, omega_ref, self._step_sizes)
        self._value_star = float(self._value(log_pi_star, log_omega_star))
        self._stepper: SMIDAStep | None = None

    def _make_stepper(self) -> SMIDAStep:
        return SMIDAStep(self.u, self.log_pi_ref, self.log_omega_ref, *self._step_sizes)

    @torch.no_grad()
    def smida_iteration(self) -> bool:
        """Apply one iteration of Algorithm 1 (``t → t + 1``); ``False``, nothing changed, for a NaN or +inf iterate."""
        if self._stepper is None or self._stepper.cost_base.device != self.u.device:  # built once per device
            self._stepper = self._make_stepper()
        log_pi, log_omega = self._stepper(self.log_pi, self.log_omega)
        if not self.check_finite(_invalid_log_probabilities(log_pi, log_omega), "log-probabilities of the iterate"):
            return False
        self.log_pi.copy_(log_pi)
        self.log_omega.copy_(log_omega)
        self.iteration += 1
        self.record_update()
        return True

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        """Log the metrics of the iterate ``t`` this step starts from, then move it to ``t + 1``."""
        self.log_dict(self.metrics(), on_step=True, on_epoch=False)
        if self.smida_iteration():
            # Lightning's placeholder optimizer: only counts the iteration in global_step (a skip does not)
            self.optimizers().step()

    @override
    def configure_optimizers(self) -> None:
        """No optimizer: the update is exact mirror descent–ascent (see the class docstring)."""

    def _value(self, log_pi: Tensor, log_omega: Tensor) -> Tensor:
        hp, refs = self.hparams, (self.log_pi_ref.exp(), self.log_omega_ref.exp())
        return game_value(self.u, log_pi.exp(), log_omega.exp(), *refs, hp.tau_leader, hp.tau_follower, self.rho)

    @torch.no_grad()
    def metrics(self) -> dict[str, Tensor]:
        """The logged diagnostics of the iterate held now (keys as in the module docstring)."""
        kl_l, kl_l_rev = kl_both(self.log_pi, self.log_pi_star, log_space=True)  # [X]
        kl_f, kl_f_rev = kl_both(self.log_omega, self.log_omega_star, log_space=True)  # [X, Y]
        weight_f = self.rho.unsqueeze(-1) * self.log_pi_star.exp()  # KL_{ρ,π*} weights the follower by ρ(x) π*(y|x)
        bound = kl_bound_at(self.iteration.double().cpu(), self._bound_start, self._step_sizes)
        value = self._value(self.log_pi, self.log_omega)
        pi, omega = self.log_pi.exp(), self.log_omega.exp()
        return {
            "leader/kl": (self.rho * kl_l).sum(),
            "leader/kl_reverse": (self.rho * kl_l_rev).sum(),
            "leader/kl_max": torch.maximum(kl_l, kl_l_rev).max(),
            "leader/kl_bound": bound.leader,
            "leader/kl_bound_simple": bound.leader_simple,
            "follower/kl": (weight_f * kl_f).sum(),
            "follower/kl_reverse": (weight_f * kl_f_rev).sum(),
            "follower/kl_max": torch.maximum(kl_f, kl_f_rev).max(),
            "follower/kl_bound": bound.follower,
            "follower/utility": (self.rho * (pi * (omega * self.u).sum(-1)).sum(-1)).sum(),
            "game/value": value,
            "game/value_gap": value - self._value_star,
        }

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the family and the skip counters; refuse an iterate with NaN or ``+inf`` log-probabilities.

        Raises:
            RuntimeError: naming the buffer (nothing is written).
        """
        checkpoint["nonfinite"] = self.nonfinite_state()
        stamp_family(self, checkpoint)
        state = checkpoint.get("state_dict") or {}
        bad = [k for k in ("log_pi", "log_omega") if k in state and _invalid_log_probabilities(state[k]).isnan().any()]
        bad += [k for k in ("u", "rho") if k in state and not torch.isfinite(state[k]).all()]
        if bad:
            raise RuntimeError(
                f"tabular SMIDA: refusing to write a checkpoint whose tensors hold NaN or inf: {bad}; resume from the "
                "previous checkpoint"
            )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another family, and an iterate of a different game (meaningless against this one)."""
        check_checkpoint_matches(self, checkpoint, {"log_pi", "log_omega"})
        self.load_nonfinite_state(checkpoint.get("nonfinite"))
        state = checkpoint.get("state_dict", {})
        for key in ("u", "log_pi_ref", "log_omega_ref"):
            saved, here = state.get(key), getattr(self, key)
            if saved is None or saved.shape != here.shape or not torch.equal(saved.to(here), here):
                raise ValueError(
                    f"the checkpoint was made on a different game ({key} differs): resume with the same game_path, "
                    "or the same num_contexts, num_actions, ensemble_size, utility, reference, seed and dtype"
                )

    @override
    def on_fit_end(self) -> None:
        """Save the final iterate, equilibrium and game to ``<log_dir>/smida_result.pt`` (not by fast_dev_run)."""
        if self.trainer.fast_dev_run:
            return
        # trainer.log_dir is a collective under DDP: every rank asks, only rank zero writes
        self._write_result(self.trainer.log_dir or self.trainer.default_root_dir)

    @rank_zero_only
    def _write_result(self, log_dir: str) -> None:
        final = {k: float(v) for k, v in self.metrics().items()}
        probs = {k: getattr(self, f"log_{k}").exp().cpu() for k in ("pi", "omega", "pi_star", "omega_star")}
        refs = {k: getattr(self, f"log_{k}").exp().cpu() for k in ("pi_ref", "omega_ref")}
        result = {**probs, "u": self.u.cpu(), **refs, "rho": self.rho.cpu(), "iteration": int(self.iteration)}
        result |= {"metrics": final, "hparams": dict(self.hparams)}
        result["provenance"] = run_provenance(self.trainer, self)  # the game file by sha256, the commit, the command
        path = os.path.join(log_dir, "smida_result.pt")
        atomic_torch_save(result, path)  # a reader never sees half a file
        rank_zero_info(
            f"SMIDA after {result['iteration']} iterations: leader KL {final['leader/kl']:.3e} "
            f"(bound {final['leader/kl_bound']:.3e}), follower KL {final['follower/kl']:.3e} "
            f"(bound {final['follower/kl_bound']:.3e}); result written to {path}"
        )


def _invalid_log_probabilities(*log_probs: Tensor) -> Tensor:
    """NaN where a log-probability is NaN or ``+inf``, 0 elsewhere (``-inf``, a zero probability, is valid)."""
    flat = torch.cat([x.flatten() for x in log_probs])
    return torch.where(flat.isnan() | flat.isposinf(), torch.nan, 0.0).to(flat.dtype)
