"""The requests the engine core holds, each with its parameters and its ``n`` sequences."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.spec_decode import SpecDecoder
from tokenmill.engine.messages import AddRequest
from tokenmill.engine.sequence import Sequence
from tokenmill.sampling_params import SamplingParams


@dataclass(eq=False)
class CoreRequest:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def done(self) -> bool:
        """Every sequence has ended and no token of it is still on its way."""
        return all(seq.is_finished and not seq.num_pending for seq in self.seqs)


class RequestTable(dict[str, CoreRequest]):
    """The live requests by id. A sequence that ends leaves the scheduler (its blocks go back) and the
    speculation's token history; a request leaves the table once every sequence has ended."""

    def __init__(
        self, scheduler: Scheduler, spec: SpecDecoder, device: torch.device, eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.scheduler, self.spec, self.device = scheduler, spec, device
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self._seq_ids = itertools.count()

    def create(self, request: AddRequest) -> CoreRequest:
        """A new request's entry, its sequences sharing one prompt tuple, each with its own generator
        where the request is seeded, and the token count at which its length ends it."""
        params, ids, eos = request.params, tuple(request.prompt_token_ids), self.eos_token_ids
        limit = self.max_model_len if params.max_tokens is None else len(ids) + params.max_tokens
        limit = min(self.max_model_len, limit)
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else (params.seed * 65537 + i) % (1 << 63)
            generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
            seq_id = next(self._seq_ids)
            now = request.arrival_time
            seqs.append(Sequence(seq_id, request.request_id, i, ids, params, now, generator, eos, token_limit=limit))
        core_request = self[request.request_id] = CoreRequest(request.request_id, params, seqs)
        return core_request

    def is_live(self, request: CoreRequest) -> bool:
        return self.get(request.request_id) is request

    def end(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` now: its placeholders go, and it leaves the batch unless it has already."""
        seq.drop_pending()
        self.spec.forget(seq)
        if not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = seq.finish_reason or reason

    def end_request(self, request: CoreRequest, reason: str) -> None:
        """End every sequence of a live request now and forget it."""
        del self[request.request_id]
        for seq in request.seqs:
            self.end(seq, reason)
            seq.matcher = None  # (no later step asks its grammar again)

    def retire(self, request: CoreRequest) -> None:
        """Forget a request whose sequences have all ended."""
        del self[request.request_id]
        for seq in request.seqs:
            self.spec.forget(seq)

    def never_finishing(self, kv: KVCacheManager) -> list[tuple[CoreRequest, str]]:
        """When nothing runs or could be admitted and no step is in flight: the requests that are done
        yet never ended (none of its sequences runs or waits, no token of it is on its way: it never
        had a sequence), and one whose first waiting sequence does not fit the whole KV pool; each
        with the reason it can never finish."""
        stuck = [
            (request, f"the engine has nothing left to run for this request ({len(request.seqs)} sequences, "
             f"n = {request.params.n}): it could never finish")
            for request in self.values() if request.done
        ]  # fmt: skip
        scheduler = self.scheduler
        if not scheduler.running and scheduler.waiting:
            seq = scheduler.waiting[0]
            pools = [kv.usable_blocks(g) for g in range(kv.num_groups)]
            stuck.append((self[seq.request_id], f"the request's {seq.num_tokens} tokens need more KV blocks than "
                          f"the pools hold ({pools} blocks of {kv.block_size}): it can never run"))  # fmt: skip
        return stuck
