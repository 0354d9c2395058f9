"""LLMEngine: the synchronous front-end over an engine core in the same process.

It is what the offline ``LLM`` and the CLI drive: requests are validated and
tokenized here, the core runs one step per ``step()`` call, and the core's new
token ids come back as ``RequestOutput`` (detokenized, stop strings applied).
The server uses ``AsyncLLM`` instead, whose core runs in a process of its own;
both share the input and output processors and the core's message types.
"""

from __future__ import annotations

import time

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.builder import model_dir_of
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.frontend.input_processor import InputProcessor, ModelLimits, check_priority
from tokenmill.engine.frontend.output_processor import OutputProcessor
from tokenmill.engine.messages import AddRequest, CoreStats, engine_stats
from tokenmill.outputs import EngineStats, OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.model_config = self.core.model_config
        self.max_model_len = self.core.max_model_len
        started = time.monotonic()
        self.tokenizer = load_tokenizer(model_dir_of(config))
        # Where start-up went: the core's phases, then the tokenizer's load.
        self.startup_seconds = {**self.core.startup_seconds, "tokenizer": time.monotonic() - started}
        limits = ModelLimits(
            self.model_config.vocab_size, self.max_model_len, config.max_logprobs, config.max_structured_output_bytes
        )
        self.inputs = InputProcessor(self.tokenizer, limits)
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = CoreStats()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        stream: bool = True,
        output_kind: OutputKind | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request; raises ValueError for bad input, leaving the engine as
        it was. ``stream=False`` reports the request only once it is finished (the offline API
        wants only the end); ``output_kind`` overrides it. ``priority`` (lower first, as in
        vLLM) needs ``scheduling_policy="priority"``."""
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        priority = check_priority(priority, self.config.scheduling_policy)
        processed = self.inputs.process(prompt, params)
        kind = output_kind or (OutputKind.CUMULATIVE if stream else OutputKind.FINAL_ONLY)
        now = time.monotonic() if arrival_time is None else arrival_time
        self.outputs.add_request(request_id, processed.text, processed.token_ids, params, kind, now)
        self.core.add_request(AddRequest(request_id, processed.token_ids, params, now, priority))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or None if unknown."""
        self.core.abort_request(request_id)
        return self.outputs.abort_request(request_id)

    def get_stats(self) -> EngineStats:
        """The engine's gauges as of its last step and its counters since it started."""
        return engine_stats(self.stats, self.core.kv.capacity_tokens, self.config.kv_cache_dtype)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests) or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step of the core; the outputs of the requests that changed. A request whose
        step failed comes back finished with ``error`` set; the others go on."""
        core_outputs = self.core.step()
        self.stats = core_outputs.stats
        processed = self.outputs.process(core_outputs)
        for abort in processed.aborts:
            self.core.handle(abort)
        return processed.outputs

    @property
    def requests(self) -> dict:
        """Requests not yet finished, by id (the front-end's view)."""
        return self.outputs.requests
