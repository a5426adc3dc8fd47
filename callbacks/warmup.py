"""Two-timescale learning-rate warm-up for a leader and a follower optimizer."""

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from alignment_games.callbacks.functional import warmup_learning_rates


def _optimizer_rate(optimizer: Any, role: str) -> float:
    """The one learning rate of ``optimizer``'s parameter groups (the ``role`` player's target when not given)."""
    rates = {float(group["lr"]) for group in optimizer.param_groups}
    if len(rates) != 1:
        raise ValueError(
            f"TwoTimescaleWarmup: the {role}'s optimizer has parameter groups with the rates {sorted(rates)}; give"
            f" `{role}_lr` (the callback sets one rate for all its groups)."
        )
    return rates.pop()


def _check_timescales(
    leader_lr: float, follower_lr: float, tau_leader: float | None, tau_follower: float | None
) -> None:
    """Refuse targets that break the two-timescale order (given both taus); without, warn if the follower is slower."""
    if not leader_lr > 0 or not follower_lr > 0:
        raise ValueError(f"`leader_lr` and `follower_lr` must be > 0, got {leader_lr} and {follower_lr}.")
    if tau_leader is not None and tau_follower is not None:
        slow, fast = leader_lr * tau_leader, follower_lr * tau_follower
        if not slow < fast:
            raise ValueError(
                "The targets break the two-timescale order eta_L * tau_L < eta_F * tau_F (Stackelberg preference"
                f" games, eq. 6): leader_lr * tau_leader = {leader_lr} * {tau_leader} = {slow:.6g} is not below"
                f" follower_lr * tau_follower = {follower_lr} * {tau_follower} = {fast:.6g}. The follower must be"
                " the fast player: raise `follower_lr` or `tau_follower`, or lower `leader_lr` or `tau_leader`."
            )
    elif follower_lr <= leader_lr:
        rank_zero_warn(
            f"TwoTimescaleWarmup: follower_lr={follower_lr} <= leader_lr={leader_lr}; with equal KL weights the"
            " follower would not be the fast player. Pass `tau_leader` and `tau_follower` to check the order."
        )


class TwoTimescaleWarmup(Callback):
    r"""Warm up the leader's learning rate and the follower/leader ratio together, then hold both (§4.3, App. D.1).

    :func:`~alignment_games.callbacks.functional.warmup_learning_rates` over training batches (saved, so a resume
    continues), written to every parameter group of both optimizers before each batch. Targets and taus not given are
    the module's (its optimizers' rates, ``hparams.tau_leader``/``tau_follower``). Logs ``{name}/leader_lr``,
    ``/follower_lr``, ``/ratio``.

    Args:
        leader_lr: the leader's target rate :math:`\eta^L` (> 0); ``None``: the leader optimizer's rate.
        follower_lr: the follower's target rate :math:`\eta^F` (> 0); ``None``: the follower optimizer's rate.
        initial_lr: both players' rate at the first batch, :math:`\eta^L_{init}` (>= 0).
        warmup_steps: :math:`T_{warm}`, number of training batches of the warm-up (0: start at the targets).
        leader_optimizer: index of the leader's optimizer in ``trainer.optimizers``.
        follower_optimizer: index of the follower's optimizer in ``trainer.optimizers``.
        tau_leader: the leader's KL weight :math:`\tau^L` for the timescale check; ``None``: the module's, if any.
        tau_follower: the follower's KL weight :math:`\tau^F`.
        name: namespace of the logged keys and part of :attr:`state_key` (two instances may coexist).

    Raises:
        ValueError: for an out-of-range rate, step count, optimizer index or tau, or targets that break
            :math:`\eta^L \tau^L < \eta^F \tau^F` (Theorem 4.3); at fit start, for a missing or multi-rate optimizer.
    """

    def __init__(
        self,
        leader_lr: float | None = None,
        follower_lr: float | None = None,
        initial_lr: float = 0.0,
        warmup_steps: int = 0,
        leader_optimizer: int = 0,
        follower_optimizer: int = 1,
        tau_leader: float | None = None,
        tau_follower: float | None = None,
        name: str = "warmup",
    ) -> None:
        super().__init__()
        for field, rate in (("leader_lr", leader_lr), ("follower_lr", follower_lr)):
            if rate is not None and not rate > 0:
                raise ValueError(f"`{field}` must be > 0, got {rate}.")
        if not initial_lr >= 0:
            raise ValueError(f"`initial_lr` must be >= 0, got {initial_lr}.")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be an integer >= 0, got {warmup_steps}.")
        if leader_optimizer < 0 or follower_optimizer < 0 or leader_optimizer == follower_optimizer:
            raise ValueError(
                "`leader_optimizer` and `follower_optimizer` must be two different non-negative indices into"
                f" `trainer.optimizers`, got {leader_optimizer} and {follower_optimizer}."
            )
        if (tau_leader is None) != (tau_follower is None):
            raise ValueError("Give both `tau_leader` and `tau_follower` (to check the timescale order) or neither.")
        if tau_leader is not None and (not tau_leader > 0 or not tau_follower > 0):
            raise ValueError(f"The KL weights must be > 0, got tau_leader={tau_leader}, tau_follower={tau_follower}.")
        if leader_lr is not None and follower_lr is not None:
            _check_timescales(leader_lr, follower_lr, tau_leader, tau_follower)
        self.leader_lr = None if leader_lr is None else float(leader_lr)  # the targets as given (None: the module's)
        self.follower_lr = None if follower_lr is None else float(follower_lr)
        self.targets = (self.leader_lr, self.follower_lr)  # resolved at fit start
        self.initial_lr, self.warmup_steps = float(initial_lr), int(warmup_steps)
        self.leader_optimizer, self.follower_optimizer = leader_optimizer, follower_optimizer
        self.tau_leader, self.tau_follower, self.name = tau_leader, tau_follower, name
        self.batches_seen = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            name=self.name, leader_optimizer=self.leader_optimizer, follower_optimizer=self.follower_optimizer
        )

    def rates(self, step: int | None = None) -> tuple[float, float, float]:
        """``(leader_rate, follower_rate, ratio)`` at ``step`` (default: the next batch, :attr:`batches_seen`).

        Raises:
            RuntimeError: before fit start when a target is left to the module's optimizers.
        """
        leader_lr, follower_lr = self.targets
        if leader_lr is None or follower_lr is None:
            raise RuntimeError("TwoTimescaleWarmup: the targets come from the module's optimizers, read at fit start")
        return warmup_learning_rates(
            self.batches_seen if step is None else step,
            initial_lr=self.initial_lr,
            leader_lr=leader_lr,
            follower_lr=follower_lr,
            warmup_steps=self.warmup_steps,
        )

    def _apply(self, trainer: pl.Trainer) -> tuple[float, float, float]:
        rates = self.rates()
        for index, lr in zip((self.leader_optimizer, self.follower_optimizer), rates):
            for group in trainer.optimizers[index].param_groups:
                group["lr"] = lr
        return rates

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        count = len(trainer.optimizers)
        for role in ("leader_optimizer", "follower_optimizer"):
            index = getattr(self, role)
            if index >= count:
                raise ValueError(
                    f"TwoTimescaleWarmup: `{role}={index}` but the module configured {count} optimizer(s);"
                    " `configure_optimizers` must return the leader's and the follower's optimizers."
                )
        # optimizer states (and rates) are restored after on_fit_start: these are the rates the module built them with
        roles = (
            (self.leader_lr, self.leader_optimizer, "leader"),
            (self.follower_lr, self.follower_optimizer, "follower"),
        )
        self.targets = tuple(given or _optimizer_rate(trainer.optimizers[i], role) for given, i, role in roles)
        taus = (self.tau_leader, self.tau_follower)
        hparams = getattr(pl_module, "hparams", {})
        if self.tau_leader is None and "tau_leader" in hparams and "tau_follower" in hparams:
            taus = (float(hparams["tau_leader"]), float(hparams["tau_follower"]))
        if self.leader_lr is None or self.follower_lr is None or taus != (self.tau_leader, self.tau_follower):
            _check_timescales(*self.targets, *taus)
        owned = {id(trainer.optimizers[self.leader_optimizer]), id(trainer.optimizers[self.follower_optimizer])}
        if any(id(getattr(config.scheduler, "optimizer", None)) in owned for config in trainer.lr_scheduler_configs):
            rank_zero_warn(
                "TwoTimescaleWarmup sets the learning rates of the leader's and the follower's optimizers before every"
                " batch; the learning-rate scheduler attached to one of them will be overridden."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Optimizer states (and their saved rates) are restored after `on_fit_start`: set the schedule's rates now.
        leader, follower, _ = self._apply(trainer)
        if self.batches_seen == 0:
            rank_zero_info(
                f"TwoTimescaleWarmup: leader {leader:.3g} -> {self.targets[0]:.3g}, follower {follower:.3g} ->"
                f" {self.targets[1]:.3g} over {self.warmup_steps} training batches."
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rates = dict(
            zip((f"{self.name}/leader_lr", f"{self.name}/follower_lr", f"{self.name}/ratio"), self._apply(trainer))
        )
        self.batches_seen += 1
        pl_module.log_dict(rates, on_step=True, on_epoch=False, batch_size=1)  # Python floats: no device read-back

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"batches_seen": self.batches_seen}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_seen = int(state_dict["batches_seen"])
