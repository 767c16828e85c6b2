"""Runs one canary on a router: split the traffic, record each request HAProxy logs, decide every few seconds, and
end it by routing every request to the canary (promote) or back to the stable colour (roll back, the canary's
requests in flight finishing).

While the canary watches quality, a share of the requests' answers is kept by HAProxy and scored on a thread of
its own (``live_quality``: the answer book's reward, or the judge), each score credited to the backend that
answered.

The state is saved after every check (``canary_store``), so a runner killed at any point and started again
(``resume``) goes on from the last check with the same policy and sums: a canary is ended only by a saved verdict,
and the verdict is saved only after the traffic follows it. Killed between the two, the resumed runner finds the
canary still running, splits again and decides again, on the same evidence plus what came since: never a canary left
with half the traffic and no one deciding. (Moving the production pointer and the registry's alias after a promote
is the caller's, once ``verdict`` says so.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nexa_dagster.core.serving.canary import STOPPED, Arm, CanaryDecision, decide
from nexa_dagster.core.serving.canary_store import Canary, CanaryStateError, begin, load, save
from nexa_dagster.core.serving.haproxy import HAProxyRouter, RouterError
from nexa_dagster.core.serving.live_quality import AnswerBook, LiveQualityScorer, LiveScore
from nexa_dagster.core.serving.request_log import RequestLogReceiver, RequestOutcome

log = logging.getLogger(__name__)


class CanaryRunner:
    """``CanaryRunner(router, folder, log_socket).start(canary)``, then ``wait()`` for its decision."""

    def __init__(
        self,
        router: HAProxyRouter,
        folder: Path,
        log_socket: Path,
        check_every_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        answer_book: AnswerBook | None = None,
        judge: Any = None,
    ) -> None:
        self.router, self.folder, self.check_every_s, self.clock = router, folder, check_every_s, clock
        self.receiver = RequestLogReceiver(log_socket, self._record)
        self.answer_book, self.judge = answer_book, judge
        self.scorer: LiveQualityScorer | None = None  # while a canary watches quality
        self.canary: Canary | None = None
        self.decision: CanaryDecision | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, canary: Canary) -> CanaryRunner:
        """Begin a new canary (refused while another runs, or when it watches quality with nothing to score
        answers with, before anything changes) and split the traffic."""
        self._can_score(canary)
        begin(canary, self.folder)
        return self._run(canary)

    def _can_score(self, canary: Canary) -> None:
        if "quality" in canary.policy.figures() and self.answer_book is None and self.judge is None:
            raise CanaryStateError(
                "the canary watches quality (max_quality_drop) but has nothing to score live answers with: give "
                "it an answer book (checkable prompts) or a judge, or max_quality_drop: null"
            )

    def resume(self) -> CanaryRunner | None:
        """Go on with the canary the folder holds, if one is running (after a restart); None if none is."""
        canary = load(self.folder)
        if canary is None or not canary.running:
            return None
        self._can_score(canary)  # a runner resuming a canary that watches quality needs its answer book too
        return self._run(canary)

    def _run(self, canary: Canary) -> CanaryRunner:
        self.canary = canary
        if "quality" in canary.policy.figures():
            self.scorer = LiveQualityScorer(self._record_quality, self.answer_book, self.judge).start()
            self.router.sample_answers(canary.policy.quality_sample_share)
        self.receiver.start()
        weights = self.router.split(canary.canary_colour, canary.policy.share)
        log.info(
            "canary %s on %s beside %s on %s: weights %s",
            canary.state.canary_id,
            canary.canary_colour,
            canary.state.stable_id,
            canary.stable_colour,
            weights,
        )
        self._thread = threading.Thread(target=self._loop, name="canary", daemon=True)
        self._thread.start()
        return self

    def _record(self, outcome: RequestOutcome) -> None:
        canary = self.canary
        if canary is None or outcome.colour not in (canary.stable_colour, canary.canary_colour):
            return
        arm: Arm = "canary" if outcome.colour == canary.canary_colour else "stable"
        with self._lock:
            canary.state.record(
                arm,
                canary.policy,
                failed=outcome.failed,
                latency_s=outcome.total_s,
                first_token_s=outcome.first_byte_s,  # the response's headers: with a stream, its first chunk
            )
        if self.scorer is not None and outcome.exchange is not None:
            self.scorer.submit(arm, outcome.exchange)

    def _record_quality(self, arm: Arm, score: LiveScore) -> None:
        """A kept answer's score, on the scorer's thread, credited to the backend that answered it."""
        canary = self.canary
        if canary is not None and canary.running:
            with self._lock:
                canary.state.record_quality(arm, score.value)

    def check(self) -> CanaryDecision:
        """Decide now and save the state; on a verdict, route the traffic first, then save the verdict."""
        canary = self.canary
        assert canary is not None, "start() or resume() first"
        with self._lock:
            decision = decide(canary.state, canary.policy, self.clock())
            save(canary, self.folder)
        if decision.verdict != "continue":
            to = canary.canary_colour if decision.verdict == "promote" else canary.stable_colour
            drained_s = self.router.route_to(to)
            self._stop_scoring()
            with self._lock:
                canary.conclude(decision)
                save(canary, self.folder)
            log.info(
                "canary %s: %s (%s); drained in %.1f s",
                canary.state.canary_id,
                decision.verdict,
                decision.reason,
                drained_s,
            )
        self.decision = decision
        return decision

    def _loop(self) -> None:
        while not self._stop.wait(self.check_every_s):
            if self.check().verdict != "continue":
                break
        self.receiver.stop()

    def wait(self, timeout_s: float) -> CanaryDecision | None:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.decision

    def _stop_scoring(self) -> None:
        scorer, self.scorer = self.scorer, None
        if scorer is not None:
            self.router.sample_answers(0)
            scorer.stop()

    def stop(self) -> None:
        """Stop checking (the state stays as last saved: ``resume`` goes on from it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.receiver.stop()
        with contextlib.suppress(RouterError, OSError):  # a router already stopped keeps no answers either
            self._stop_scoring()

    def stop_canary(self, reason: str) -> CanaryDecision:
        """A person ends the canary now (issue 50): "roll back", reason ``stopped by a person: <reason>``, with the
        figures so far. As ``check`` does: the checks stop, every new request goes back to the stable colour (the
        canary's in flight finish), then the verdict is saved. A verdict the runner reached before the stop stands
        and is returned as it is (its traffic already follows it)."""
        canary = self.canary
        assert canary is not None, "start() or resume() first"
        self._stop.set()  # no check after this one: the loop ends after the one it may be in
        if self._thread is not None:
            self._thread.join()
        if self.decision is not None and self.decision.verdict != "continue":
            return self.decision
        with self._lock:
            figures = decide(canary.state, canary.policy, self.clock()).figures
        decision = CanaryDecision("roll back", f"{STOPPED}{reason}", figures)
        drained_s = self.router.route_to(canary.stable_colour)
        self._stop_scoring()  # as check() does after a verdict's route
        with self._lock:
            canary.conclude(decision)
            save(canary, self.folder)
        self.receiver.stop()
        log.info("canary %s: %s; drained in %.1f s", canary.state.canary_id, decision.reason, drained_s)
        self.decision = decision
        return decision
