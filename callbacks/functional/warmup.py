"""Two-timescale learning-rate warm-up of deep-SMIDA (Stackelberg preference games, App. D.1)."""


def warmup_learning_rates(
    step: int, initial_lr: float, leader_lr: float, follower_lr: float, warmup_steps: int
) -> tuple[float, float, float]:
    r"""Leader rate, follower rate and follower/leader ratio after ``step`` warm-up steps (App. D.1).

    With :math:`p_t = \min(t / T_{warm}, 1)` (1 when ``warmup_steps`` is 0):

    .. math::
        \eta^L_t = \eta^L_{init} + p_t (\eta^L - \eta^L_{init}), \qquad
        \eta^F_t = \eta^L_t \, [1 + p_t (\eta^F / \eta^L - 1)].

    Raises:
        ValueError: if ``step`` or ``warmup_steps`` is negative or ``leader_lr`` is not positive.

    Example:
        >>> warmup_learning_rates(2, initial_lr=1.0, leader_lr=3.0, follower_lr=6.0, warmup_steps=4)
        (2.0, 3.0, 1.5)
    """
    if step < 0:
        raise ValueError(f"`step` must be >= 0, got {step}.")
    if warmup_steps < 0:
        raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}.")
    if leader_lr <= 0:
        raise ValueError(f"`leader_lr` must be > 0, got {leader_lr}.")
    progress = 1.0 if warmup_steps == 0 else min(step / warmup_steps, 1.0)
    leader = initial_lr + progress * (leader_lr - initial_lr)
    ratio = 1.0 + progress * (follower_lr / leader_lr - 1.0)
    return leader, leader * ratio, ratio
