"""OutputProcessor: from sampled tokens to what callers see (text, stops, logprobs, reports).

The engine hands every sampled token to :meth:`OutputProcessor.process_token`, which appends it
to the sequence, extends the sample's text, and decides whether it stops (EOS, stop token,
stop string, stop regex, finished grammar, length) by setting ``seq.finish_reason``. The
processor owns the per-sample output state (:class:`SampleOutput`: detokenizer, text, stop
reason, logprobs and the report cursors); :class:`~prefixkv.engine.sequence.Sequence` keeps
only tokens, blocks and status. Lifecycle: :meth:`add` when a request is queued,
:meth:`finish` when it ends (its last output; the state is dropped). :meth:`snapshot` reads
without changing anything; :meth:`report` is the one call that advances the delta cursors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from prefixkv.engine.sampling_params import SamplingParams
from prefixkv.engine.sequence import Request
from prefixkv.engine.sequence import Sequence as Seq
from prefixkv.engine.stop_regex import StepBudget, first_match, needs_backtracking


class TextStream(Protocol):
    """Incremental detokenizer of one sample (``push`` new ids -> new text; ``flush`` at end)."""

    def push(self, token_ids: Iterable[int]) -> str: ...

    def peek(self, token_ids: Sequence[int]) -> list[str]: ...

    def flush(self) -> str: ...


@dataclass(slots=True, eq=False)
class SampleOutput:
    """One sample's output state: its text so far (stop strings cut off), why it stopped, its
    logprobs, and how much of it was already reported (``num_reported_*``)."""

    detokenizer: TextStream | None
    text: str = ""
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_check_from: int = 0
    num_reported_tokens: int = 0
    num_reported_chars: int = 0


class OutputProcessor:
    """Text, stop decisions and outputs of the engine's requests (one thread, like the engine).

    Args:
        make_detokenizer: a fresh :class:`TextStream` for a sample's params (``None``: no text).
        eos_token_ids: ids that end a sample (unless ``ignore_eos``).
        max_model_len: a sample stops with ``"length"`` when its sequence reaches it.
    """

    def __init__(
        self,
        make_detokenizer: Callable[[SamplingParams], TextStream | None],
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        self._make_detokenizer = make_detokenizer
        self._eos = eos_token_ids
        self._max_model_len = max_model_len
        self._samples: dict[str, list[SampleOutput]] = {}
        self._regex_budgets: dict[str, StepBudget] = {}  # this step's, per request using one

    def add(self, req: Request) -> None:
        """Start tracking ``req`` (its sequences are built); one :class:`SampleOutput` each."""
        self._samples[req.request_id] = [
            SampleOutput(self._make_detokenizer(s.params), logprobs=[] if s.params.logprobs is not None else None)
            for s in req.seqs
        ]

    def sample(self, seq: Seq) -> SampleOutput:
        """The output state of ``seq``."""
        return self._samples[seq.request.request_id][seq.index]

    def process_token(self, seq: Seq, token_id: int, logprobs: dict[int, Logprob] | None = None) -> None:
        """Append a sampled token, extend the text, and set ``seq.finish_reason`` if it must stop.

        vLLM's rules: no stop (EOS, stop id, stop string) before ``min_tokens`` tokens, and no
        stop string found in the text of the first ``min_tokens`` tokens; the text of a stop
        id or EOS (and a matched stop string) is left out unless ``include_stop_str_in_output``.
        A ``stop_regex`` match (checked after the stop strings, under the same ``min_tokens``
        rule) keeps the text; its ``ValueError`` when the request's searches pass their time
        budget for this step (reset by :meth:`report`) fails the request (the engine's isolation).
        """
        out = self.sample(seq)
        seq.append_token(token_id)
        if logprobs is not None and out.logprobs is not None:
            if out.detokenizer is not None:  # each candidate's text in this sample's context
                logprobs = in_context(logprobs, out.detokenizer)
            elif not seq.params.detokenize:
                logprobs = {t: Logprob(lp.logprob, lp.rank) for t, lp in logprobs.items()}
            out.logprobs.append(logprobs)
            out.cumulative_logprob += logprobs[token_id].logprob
        params = seq.params
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self._eos:
                seq.finish_reason = "stop"
            elif token_id in params.stop_ids:
                seq.finish_reason, out.stop_reason = "stop", token_id
        old_len = len(out.text)
        if out.detokenizer is not None and (
            seq.finish_reason is None or params.include_stop_str_in_output
        ):
            out.text += out.detokenizer.push((token_id,))
        if n_out <= params.min_tokens and params.min_tokens:
            out.stop_check_from = len(out.text)
        elif seq.finish_reason is None:
            if params.stop_strings and _check_stop_strings(seq, out, old_len):
                return
            if params.stop_regexes:
                rid = seq.request.request_id
                budget = self._regex_budgets.get(rid)
                if budget is None:  # the request's first sample this step: a fresh budget
                    budget = StepBudget.for_samples(
                        len(seq.request.seqs), backtracking=needs_backtracking(params.stop_regexes))
                    self._regex_budgets[rid] = budget
                hit = first_match(params.stop_regexes, out.text, out.stop_check_from, old_len,
                                  budget)  # in order; the text is kept (SGLang's rule)
                if hit is not None:
                    seq.finish_reason, out.stop_reason = "stop", hit.pattern
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_done():
            seq.finish_reason = "stop"  # complete (only a stop token could follow) or failed
        if seq.finish_reason is None and (
            n_out >= seq.request.max_tokens or len(seq.token_ids) >= self._max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None and out.detokenizer is not None:
            out.text += out.detokenizer.flush()  # less a character cut by the end

    def visible_text(self, seq: Seq) -> str:
        """Text safe to report: while running, hold back what could start a stop string."""
        out = self.sample(seq)
        stops = seq.params.stop_strings
        if seq.finish_reason is not None or not stops:
            return out.text
        hold = max(len(s) for s in stops) - 1
        return out.text[: max(out.num_reported_chars, len(out.text) - hold)]

    def snapshot(self, req: Request) -> RequestOutput:
        """A :class:`RequestOutput` of ``req`` now, deltas since the last :meth:`report`;
        changes nothing."""
        return self._build(req, advance=False)

    def report(self, req: Request) -> RequestOutput:
        """:meth:`snapshot`, then advance the delta cursors: the next output's deltas start here
        (the engine reports each changed request once per step: its stop-regex budget restarts)."""
        self._regex_budgets.pop(req.request_id, None)
        return self._build(req, advance=True)

    def finish(self, req: Request) -> RequestOutput:
        """The last :meth:`report` of ``req``; its output state is dropped."""
        out = self._build(req, advance=True)
        del self._samples[req.request_id]
        self._regex_budgets.pop(req.request_id, None)
        return out

    def _build(self, req: Request, *, advance: bool) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            s = self.sample(seq)
            text = self.visible_text(seq)
            ids = seq.output_token_ids
            outs.append(CompletionOutput(
                seq.index, text, ids, seq.finish_reason, s.stop_reason,
                text[s.num_reported_chars:], ids[s.num_reported_tokens:],
                None if s.logprobs is None else list(s.logprobs),
                None if s.logprobs is None else s.cumulative_logprob,
            ))
            if advance:
                s.num_reported_chars, s.num_reported_tokens = len(text), len(ids)
        m = req.metrics
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
            req.num_cached_tokens or 0,
            RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time),
            error=req.error,
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            num_external_cached_tokens=req.num_external_cached_tokens,
            num_external_queried_tokens=req.num_external_queried_tokens,
            num_external_cached_tokens_by_tier=dict(req.num_external_cached_tokens_by_tier),
        )


def in_context(entry: dict[int, Logprob], stream: TextStream) -> dict[int, Logprob]:
    """``entry`` with each ``decoded_token`` the text its token adds after what ``stream`` has
    seen (:meth:`~prefixkv.models.tokenizer.IncrementalDetokenizer.peek`), as vLLM reports it."""
    texts = stream.peek(list(entry))
    return {t: Logprob(lp.logprob, lp.rank, text) for (t, lp), text in zip(entry.items(), texts)}


def _check_stop_strings(seq: Seq, out: SampleOutput, old_len: int) -> bool:
    # Only a match ending in the new text is new: the text before it was checked already.
    stops = seq.params.stop_strings
    start = max(out.stop_check_from, old_len - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        pos = out.text.find(s, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is None:
        return False
    keep = best[0] + len(best[1]) if seq.params.include_stop_str_in_output else best[0]
    out.text = out.text[:keep]
    seq.finish_reason, out.stop_reason = "stop", best[1]
    return True
