"""Caffe's learning-rate policies (SGDSolver::GetLearningRate, sgd_solver.cpp), computed on the host.

The rate of one iteration is ``base_lr`` times a factor of the iteration number:

- ``fixed``: 1
- ``step``: ``gamma ^ floor(iter / stepsize)``
- ``exp``: ``gamma ^ iter``
- ``inv``: ``(1 + gamma * iter) ^ (-power)``
- ``multistep``: ``gamma ^ current_step``; ``current_step`` advances by at most one per call, when
  ``iter >= stepvalue[current_step]``
- ``poly``: ``(1 - iter / max_iter) ^ power``
- ``sigmoid``: ``1 / (1 + exp(-gamma * (iter - stepsize)))``

``current_step`` is solver state (it is saved in the solverstate): ``step`` sets it to ``iter // stepsize``,
``multistep`` advances it, the other policies leave it alone. The solver passes the rate into its compiled
step as a scalar, so a changing rate never recompiles anything.
"""

from __future__ import annotations

import numpy as np

from caffejax.errors import SolverError

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def learning_rate(param, iter: int, current_step: int) -> tuple[float, int]:
    """``(rate, current_step)`` for iteration ``iter``, as GetLearningRate computes and updates them.

    ``param`` is a SolverParameter. The rate is rounded to float32, as Caffe keeps it in a ``Dtype``.
    """
    policy = param.lr_policy
    base_lr = param.base_lr
    if policy == "fixed":
        factor = 1.0
    elif policy == "step":
        _require(param.stepsize > 0, "step", "stepsize must be positive")
        _require(param.gamma >= 0, "step", "gamma must be non-negative")
        current_step = iter // param.stepsize
        factor = _pow(param.gamma, current_step)
    elif policy == "exp":
        _require(param.gamma >= 0, "exp", "gamma must be non-negative")
        factor = _pow(param.gamma, iter)
    elif policy == "inv":
        _require(param.gamma >= 0, "inv", "gamma must be non-negative")
        factor = _pow(1.0 + param.gamma * iter, -param.power)
    elif policy == "multistep":
        _require(param.gamma >= 0, "multistep", "gamma must be non-negative")
        if current_step < len(param.stepvalue) and iter >= param.stepvalue[current_step]:
            current_step += 1
        factor = _pow(param.gamma, current_step)
    elif policy == "poly":
        _require(param.max_iter != 0, "poly", "max_iter must be set (the rate decays to 0 at max_iter)")
        factor = _pow(1.0 - iter / param.max_iter, param.power)
    elif policy == "sigmoid":
        _require(param.gamma >= 0, "sigmoid", "gamma must be non-negative")
        _require(param.stepsize > 0, "sigmoid", "stepsize must be positive")
        with np.errstate(over="ignore"):
            factor = float(1.0 / (1.0 + np.exp(np.float64(-param.gamma * (iter - param.stepsize)))))
    else:
        raise SolverError(f"Unknown learning rate policy: '{policy}' (Caffe's policies: {', '.join(POLICIES)})")
    return float(np.float32(base_lr * factor)), current_step


def check_policy(param) -> None:
    """Fail at solver construction, not at the first update, on a policy Caffe does not know."""
    if param.lr_policy not in POLICIES:
        raise SolverError(f"Unknown learning rate policy: '{param.lr_policy}' (Caffe's policies: "
                          f"{', '.join(POLICIES)})")
    learning_rate(param, 0, 0)  # runs the policy's own checks (stepsize, gamma, max_iter)


def _pow(base: float, exponent: float) -> float:
    # C's pow: a negative base with a fractional exponent is NaN, 0 to a negative power is inf.
    with np.errstate(all="ignore"):
        return float(np.power(np.float64(base), np.float64(exponent)))


def _require(ok: bool, policy: str, message: str) -> None:
    if not ok:
        raise SolverError(f"lr_policy '{policy}': {message}")
