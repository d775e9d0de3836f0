"""The entropy bonus's coefficient: fixed, or steered towards a target entropy.

A fixed bonus is a compromise that fails both ways on the debug tasks: too
small and the policy turns deterministic on a wrong answer before the task is solved (entropy
collapse: a wrong fixed answer then gets zero advantage forever); large enough to stop that and it
pushes probability onto the whole vocabulary at positions the policy has not learnt yet, so
entropy climbs back and reward stalls. Steering the coefficient (as SAC's temperature, or
Skywork-OR1's adaptive entropy control) acts only while entropy is below `target`: the coefficient
grows by `lr * (target - entropy)` per step, shrinks the same way above it, and stays in
[0, coef_max]. With target 0 the coefficient is the configured constant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EntropyControl:
    coef: float
    target: float = 0.0
    lr: float = 0.0
    coef_max: float = 0.0

    @property
    def adaptive(self) -> bool:
        return self.target > 0

    @property
    def needs_grad(self) -> bool:
        """Whether the step must compute the entropy with its gradient (the bonus may act)."""
        return self.adaptive or self.coef > 0

    def update(self, entropy: float) -> float:
        """After a step whose mean loss-token entropy was `entropy`: the next step's coefficient."""
        if self.adaptive:
            self.coef = min(self.coef_max, max(0.0, self.coef + self.lr * (self.target - entropy)))
        return self.coef

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # A checkpoint from a fixed-coefficient run carries nothing: keep the configured start.
        if self.adaptive and "coef" in state:
            self.coef = float(state["coef"])
