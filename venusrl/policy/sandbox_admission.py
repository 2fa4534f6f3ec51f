"""Which sandboxes a node's pool admits, and whom it preempts when memory runs high.

Pure policy (DESIGN.md contract 1): a snapshot of running and pending sandboxes in, a decision out;
no clock, no I/O, no torch, so the pool and the simulator run the same objects.

Footprint admission (DESIGN.md, "Footprint admission": admit by measured physical footprint plus
predicted growth, not by declared quota). With `fp_i` the measured footprint of running sandbox i,
`peak(t)` the predicted peak footprint of template t and B the memory budget, a pending sandbox of
template t is admitted while

    sum_i max(fp_i, peak(t_i)) + peak(t) <= safety_fraction * B

that is: every running sandbox may still grow to its template's predicted peak, and the newcomer
may reach its own. When the *measured* total nevertheless exceeds `high_water_fraction * B` (a
prediction was wrong), the lowest-priority sandboxes are preempted, newest first, until the total
is back under the mark, and nothing is admitted in that round: the pool chooses the victim before
the kernel's OOM killer picks one at random.

Quota admission is the baseline every RL framework uses: admit while the declared quotas fit,
`sum_i declared_i + declared <= B`, whatever the sandboxes really touch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunningSandbox:
    sandbox_id: str
    template: str
    priority: int
    started: int  # order of admission (higher = newer)
    footprint_bytes: int  # measured physical (private) footprint
    declared_bytes: int


@dataclass(frozen=True)
class PendingSandbox:
    request_id: str
    template: str
    priority: int
    arrival: int
    declared_bytes: int


@dataclass(frozen=True)
class PoolSnapshot:
    running: Sequence[RunningSandbox]
    pending: Sequence[PendingSandbox]
    budget_bytes: int
    peak_bytes: Mapping[str, int] = field(default_factory=dict)  # predicted peak per template


@dataclass(frozen=True)
class AdmissionDecision:
    admit: tuple[str, ...]  # pending request ids, in admission order
    preempt: tuple[str, ...]  # running sandbox ids


def _queue_order(p: PendingSandbox) -> tuple[int, int]:
    return (-p.priority, p.arrival)


@dataclass(frozen=True)
class FootprintAdmission:
    safety_fraction: float = 0.9
    high_water_fraction: float = 0.95

    def __post_init__(self) -> None:
        if not 0 < self.safety_fraction <= self.high_water_fraction <= 1:
            raise ValueError(
                "need 0 < safety_fraction <= high_water_fraction <= 1, got "
                f"{self.safety_fraction} and {self.high_water_fraction}"
            )

    def decide(self, snap: PoolSnapshot) -> AdmissionDecision:
        def peak(template: str, declared: int) -> int:
            # No prediction yet for a template: trust its declaration (conservative).
            return snap.peak_bytes.get(template, declared)

        preempt = self._preempt(snap)
        if preempt:  # the predictions just proved too low: shed load, admit nothing
            return AdmissionDecision((), preempt)
        committed = sum(
            max(s.footprint_bytes, peak(s.template, s.declared_bytes)) for s in snap.running
        )
        limit = self.safety_fraction * snap.budget_bytes
        admit = []
        for p in sorted(snap.pending, key=_queue_order):
            need = peak(p.template, p.declared_bytes)
            if committed + need > limit:
                break  # FCFS within a priority: a small latecomer does not starve a big one
            committed += need
            admit.append(p.request_id)
        return AdmissionDecision(tuple(admit), ())

    def _preempt(self, snap: PoolSnapshot) -> tuple[str, ...]:
        used = sum(s.footprint_bytes for s in snap.running)
        mark = self.high_water_fraction * snap.budget_bytes
        victims = sorted(snap.running, key=lambda s: (s.priority, -s.started))
        chosen = []
        for s in victims:
            if used <= mark:
                break
            chosen.append(s.sandbox_id)
            used -= s.footprint_bytes
        return tuple(chosen)


@dataclass(frozen=True)
class QuotaAdmission:
    """The baseline: admit by declared memory; never preempts (the kernel OOM-kills instead)."""

    def decide(self, snap: PoolSnapshot) -> AdmissionDecision:
        committed = sum(s.declared_bytes for s in snap.running)
        admit = []
        for p in sorted(snap.pending, key=_queue_order):
            if committed + p.declared_bytes > snap.budget_bytes:
                break
            committed += p.declared_bytes
            admit.append(p.request_id)
        return AdmissionDecision(tuple(admit), ())


@dataclass
class PeakEstimator:
    """Per-template peak footprint learned online from finished sandboxes.

    Until `min_samples` sandboxes of a template have finished, it predicts nothing (admission then
    uses the template's prior or its declared memory); afterwards, the `quantile` of the last
    `window` peaks times `1 + margin`. `quantile=1.0` (the largest peak) never under-reserves a
    workload it has seen; a lower quantile reserves for the typical sandbox and leaves rare spikes
    to the headroom above `safety_fraction` and to high-water preemption, which is what lets a node
    multiplex many sandboxes that rarely spike at the same time. Pure state: the pool feeds it
    observations; it reads nothing itself.
    """

    min_samples: int = 3
    margin: float = 0.2
    quantile: float = 1.0
    window: int = 256
    _peaks: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.min_samples < 1 or self.window < self.min_samples or self.margin < 0:
            raise ValueError("need min_samples >= 1, window >= min_samples and margin >= 0")

    def observe_finished(self, template: str, peak_bytes: int) -> None:
        peaks = self._peaks.setdefault(template, [])
        peaks.append(peak_bytes)
        del peaks[: -self.window]

    def predictions(self) -> dict[str, int]:
        out = {}
        for t, peaks in self._peaks.items():
            if len(peaks) >= self.min_samples:
                ranked = sorted(peaks)
                at = ranked[max(0, math.ceil(self.quantile * len(ranked)) - 1)]  # nearest rank
                out[t] = int(at * (1 + self.margin))
        return out
