"""What the engine core reports after a step: each request's news since the last report (new
tokens, finishes, errors), with its counters as of its first news of the step."""

from __future__ import annotations

import msgspec

from tokenmill.engine.core.request import CoreRequest
from tokenmill.engine.messages import CoreOutputs, CoreStats, RequestDelta, SeqDelta
from tokenmill.engine.sequence import Sequence
from tokenmill.outputs import ERROR_ENGINE


class StepOutputs:
    def __init__(self) -> None:
        self._deltas: dict[str, RequestDelta] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deltas

    def take(self, stats: CoreStats) -> CoreOutputs:
        """Every request's news, and a copy of ``stats`` (the in-process caller may keep it)."""
        outputs, self._deltas = list(self._deltas.values()), {}
        return CoreOutputs(outputs, msgspec.structs.replace(stats))

    def drop(self, request_id: str) -> None:
        """Forget a request's news (it was aborted: nothing follows an abort)."""
        self._deltas.pop(request_id, None)

    def lone_token(self, seq: Sequence, token: int) -> None:
        """The news of a request of one sequence whose only news is one token (most steps' most requests)."""
        self._deltas[seq.request_id] = RequestDelta(
            seq.request_id,
            [SeqDelta(seq.index, [token])],
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            first_scheduled_time=seq.first_scheduled_time,
            spec_drafts=seq.spec_drafts,
            spec_draft_tokens=seq.spec_draft_tokens,
            spec_accepted_tokens=seq.spec_accepted_tokens,
        )

    def request(self, request: CoreRequest) -> RequestDelta:
        delta = self._deltas.get(request.request_id)
        if delta is None:
            first = request.seqs[0]
            preemptions = drafts = draft_tokens = accepted = 0
            for seq in request.seqs:  # (one loop: this runs for every request every step)
                preemptions += seq.num_preemptions
                drafts += seq.spec_drafts
                draft_tokens += seq.spec_draft_tokens
                accepted += seq.spec_accepted_tokens
            delta = self._deltas[request.request_id] = RequestDelta(
                request.request_id,
                [],
                num_cached_tokens=first.num_cached_tokens,
                num_preemptions=preemptions,
                first_scheduled_time=first.first_scheduled_time,
                spec_drafts=drafts,
                spec_draft_tokens=draft_tokens,
                spec_accepted_tokens=accepted,
            )
        return delta

    def sequence(self, request: CoreRequest, seq: Sequence) -> SeqDelta:
        delta = self.request(request)
        for item in delta.seqs:
            if item.index == seq.index:
                return item
        item = SeqDelta(seq.index, [], [] if seq.params.logprobs is not None else None)
        delta.seqs.append(item)
        return item

    def fail(self, request_id: str, message: str, seqs: list[Sequence], kind: str = ERROR_ENGINE) -> None:
        """End a request with ``message``; ``kind``: whose fault (``tokenmill.outputs.ERROR_ENGINE``)."""
        self._deltas[request_id] = RequestDelta(
            request_id,
            [SeqDelta(s.index, [], finish_reason="abort") for s in seqs],
            finished=True,
            error=message,
            error_kind=kind,
        )
