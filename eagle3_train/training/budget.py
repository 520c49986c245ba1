"""``loop.max_minutes``: a wall-clock budget for the training loop.

The lr schedule (warmup, then the decay) is a function of the total number of steps, so a budget in
minutes has to become a number of steps before the decay starts. :class:`WallClockBudget` measures
the loop's rate at each logged step and every :data:`BUDGET_EVERY` steps, and sizes the total to
what fits in the minutes left, never
above what the epochs and ``loop.max_steps`` allow. The first logged window holds start-up costs
(compilation, the first batches' allocations), so the total keeps its size (the planned one, or what
a resumed run had) until a second window has passed, and the rate is measured from the end of the
first; evaluations inside the loop count in the rate as they count in the minutes. Once the budget
is spent the total becomes the current step: the loop ends there.
"""

from __future__ import annotations

from dataclasses import dataclass

BUDGET_EVERY = 10
"""the trainer sizes a budget's total at least every this many steps (and at each logged step), so a
short budget is not overrun for want of a log line (loop.log_every=50 ran 54 s of a 46 s budget)"""


@dataclass
class WallClockBudget:
    """Sizes the run to ``seconds`` of loop time.

    Args:
        seconds: the budget (``loop.max_minutes`` x 60).
        planned: the steps the epochs and ``loop.max_steps`` allow: the total never exceeds it.
        spent: loop seconds of earlier runs of the same output (a resumed run counts them).
    """

    seconds: float
    planned: int
    spent: float = 0.0
    _base: tuple[int, float] | None = None  # (step, loop seconds) at the end of the first window seen

    def total(self, step: int, elapsed: float, current: int) -> int:
        """The total steps to train, at ``step`` after ``elapsed`` loop seconds of this run, whose
        total is ``current`` (kept through the first window)."""
        used = self.spent + elapsed
        if used >= self.seconds:
            return min(step, self.planned)
        if step >= self.planned:
            return self.planned
        if self._base is None:  # the first window: its rate includes start-up; the total waits for a steady one
            self._base = (step, elapsed)
            return max(step, min(self.planned, current))
        if step > self._base[0] and elapsed > self._base[1]:
            rate = (step - self._base[0]) / (elapsed - self._base[1])
        else:
            rate = step / max(elapsed, 1e-9)
        fits = step + int(rate * (self.seconds - used))
        return max(step, min(self.planned, fits))
