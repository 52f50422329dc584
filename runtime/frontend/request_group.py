"""The samples of one `generate` call (`n` of them; usually one), served by one task.

Each sample is a request of its own for the actors (they share the prompt's KV), with its own
stream and output processor here; the streams share a `Signal`, so the task wakes when any
sample has something, and yields each sample's outputs tagged with its index.
"""

from __future__ import annotations

import time

import trio
from transformers import PreTrainedTokenizerBase

from runtime.frontend.output_processor import OutputProcessor
from runtime.frontend.request_stream import RequestStream, Signal
from runtime.protocol import RequestOutput
from runtime.wire.messages import AddRequest


class RequestGroup:
    def __init__(
        self, label: str, adds: list[AddRequest], tokenizer: PreTrainedTokenizerBase
    ) -> None:
        self.adds = adds
        self.signal = Signal()
        self.streams = [RequestStream(self.signal) for _ in adds]
        self.processors = [
            OutputProcessor(label, tokenizer, add.prompt_token_ids, add.params, index)
            for index, add in enumerate(adds)
        ]
        self.detokenize_seconds = 0.0

    @property
    def finished(self) -> bool:
        return all(stream.consumed for stream in self.streams)

    @property
    def upstream_done(self) -> bool:
        """The actors have nothing more for any sample: its output is all here."""
        return all(stream.upstream_done for stream in self.streams)

    async def wait(self) -> None:
        """Until some sample has something to take."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not any(stream.ready for stream in self.streams):
            await self.signal.wait()

    def take(self) -> list[tuple[int, RequestOutput]]:
        """(sample index, output) for every sample with something new; raises a sample's
        error (the whole call fails with it). A sample a stop string ends here is ended in
        its stream too, so that nothing more comes out of it."""
        started = time.perf_counter()
        outputs = []
        for i, stream in enumerate(self.streams):
            if stream.ready:
                output = self.processors[i].process(stream.take())
                if output.finished:
                    stream.end(output.finish_reason or "stop", taken=True)
                outputs.append((i, output))
        self.detokenize_seconds += time.perf_counter() - started
        return outputs
