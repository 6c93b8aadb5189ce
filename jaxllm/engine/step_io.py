"""A scheduled step into the device and its tokens back out: the padded batch, its sampling rows
(forked siblings and draft positions included) and its grammar bitmask on the way in; the one
device sync, the scheduler's update, stop strings and the request outputs on the way out.

`StepIO` is a mixin of `LLMEngine` (llm_engine.py), whose `step` calls `_launch` and `_process`
(with async scheduling one step apart); it reads the engine's runner, sampler, dispatcher,
scheduler, `seqs` / `parents` maps, and the beam search, speculative decoder and structured
outputs when they are on.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from jaxllm.engine.batch import build_batch, with_logit_rows
from jaxllm.engine.dispatch import PAD_ROW, Launched
from jaxllm.engine.outputs_builder import Sequence, make_output
from jaxllm.engine.sampler import SampleRow
from jaxllm.outputs import RequestOutput
from jaxllm.runtime.request import RequestStatus
from jaxllm.runtime.scheduler import SchedulerOutput
from jaxllm.sampling_params import RequestOutputKind
from jaxllm.spec.shift import host_rows

IDLE_WAIT_S = 0.005  # at most, with only KV loads in flight (a finished load wakes it at once)


class StepIO:
    def _sample_row(self, request_id: str, own: int = 0) -> SampleRow:
        """`own`: the tokens the scheduler just counted in `num_pending` for this row's step
        (1, or 1 + its drafts), which are not in flight before it."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return self.beam.sample_row(request_id)
        return SampleRow(seq.params, seq.req.prompt_token_ids, seq.req.output_token_ids, seq.seed,
                         self.eos_ids[0] if self.eos_ids else None, seq.req.num_pending - own)

    def _overlaps(self, prev: Launched) -> bool:
        """Can the next step be scheduled while `prev` runs? Not when it forks siblings, has
        penalties, or beam search reads it; with speculative decoding, only when the step
        corrects itself on the device (spec/shift.py) and every request that verifies drafts in
        `prev` is greedy past its min_tokens: their counts in flight assume every draft
        accepted, which a sampled row's random stream and EOS suppression would read."""
        if not prev.overlappable or self.beam is not None:
            return False
        if not prev.spec_rows:  # a draft model or EAGLE head proposes only between synchronous steps
            return self.spec is None or self.spec.overlap
        if not self.runner.spec_width:  # (the step cannot correct itself)
            return False
        for rid in prev.spec_rows:
            seq = self.seqs.get(rid)
            if seq is not None and not (seq.params.is_greedy
                                        and len(seq.req.output_token_ids) >= seq.params.min_tokens):
                return False
        return True

    def _launch(self, out: SchedulerOutput, prev: Launched | None) -> Launched | None:
        if out.empty:
            if out.has_kv_ops:  # saves, loads to start or write, page moves: nothing to compute
                self.dispatcher.submit(out)
            if self.scheduler.loading and prev is None and self.connector is not None:
                # only KV fetches and loads left: wait until one may be done (no spinning)
                self.connector.wait_for_progress(IDLE_WAIT_S)
            elif self.scheduler.waiting:
                # only requests waiting on their grammar's compile are left: do not spin hot
                # (a spinning loop holds the GIL the compile and the HTTP threads need)
                time.sleep(0.001)
            return None
        now = time.time()
        hb = build_batch(out, self.token_buckets, self.seq_buckets, self.cfg.block_size,
                         self.runner.max_blocks, prev.row_of if prev is not None else None)
        if prev is not None and prev.spec_rows:  # the device corrects for prev's acceptance
            hb = host_rows(hb, out, prev, self.runner.spec_width)
            if self.spec is not None:
                self.spec.num_overlapped += 1
        rows = [self._sample_row(s.request_id, 1 + len(s.spec_token_ids)) if s.sample else PAD_ROW
                for s in out.scheduled]
        row_of = {s.request_id: i for i, s in enumerate(out.scheduled)}
        extra = []  # token index of each logits row past the batch's own
        for i, s in enumerate(out.scheduled):
            for f in s.fork_ids:  # n > 1 siblings sample from their leader's row
                row_of[f] = len(rows)
                rows.append(self._sample_row(f))
                extra.append(int(hb.logits_indices[i]))
            seq = self.seqs.get(s.request_id)
            if seq is not None and self.parents[seq.parent_id].metrics.first_scheduled_time is None:
                self.parents[seq.parent_id].metrics.first_scheduled_time = now
        spec_rows, verify = {}, None
        if self.spec is not None and any(s.spec_token_ids for s in out.scheduled):
            idx, spec_rows = self.spec.add_rows(out, hb.query_start_loc, rows)
            extra += idx
        if extra:
            hb = with_logit_rows(hb, extra, self.token_buckets, self.seq_buckets)
        sbatch = self.sampler.prepare(rows, hb.block_tables.shape[0])
        if spec_rows:
            verify = self.spec.verifier.bind(self.spec.draft_ids(out, spec_rows, sbatch.num_rows))
        launched = Launched(out, rows, row_of, None, mask=Future() if sbatch.masked else None,
                            num_rows=sbatch.num_rows, spec_rows=spec_rows)
        if prev is None:  # every earlier token is known: fill now
            self._fill_mask(launched)
        # A speculative step the next `step` reads before scheduling runs on this thread when it can
        inline = self.spec is not None and not self._overlaps(launched)
        launched.sample = self.dispatcher.submit(out, hb, sbatch, prev.sample if prev else None, launched.mask,
                                                 verify, inline=inline)
        return launched

    def _fill_mask(self, launched: Launched) -> None:
        """Hand the step's draw its bitmask, made from the matchers (which have seen every
        earlier token) off the engine thread by default (`StructuredManager.hand_off`), so the
        host's detokenizing and the server's streaming go on meanwhile (the next advance of
        these matchers waits for this draw, so nothing moves them under it)."""
        if launched.mask is None or launched.mask_handed:  # unconstrained, or once per step
            return
        launched.mask_handed = True
        rows = [(sid, i) for sid, i in launched.row_of.items() if sid in self.structured]
        try:
            self.structured.hand_off(rows, launched.num_rows, launched.mask)
        except BaseException as exc:  # the dispatch thread must not wait forever
            launched.mask.set_exception(exc)
            raise

    def _process(self, launched: Launched, then: Launched | None = None) -> list[RequestOutput]:
        """Read a step's sampled tokens (the one device sync) and advance its requests.

        `then`: the step dispatched after this one; its bitmask (structured outputs) is filled
        as soon as the matchers have this step's tokens, before the detokenizing below."""
        out, rows, row_of = launched.out, launched.rows, launched.row_of
        sout = launched.result().fetch()
        # Beam-search rows get no token: the scheduler parks them for the beam search to fork.
        sampled = {rid: int(sout.token_ids[i]) for rid, i in row_of.items()
                   if rid in self.seqs and rows[i] is not PAD_ROW}
        spec_rows, first = launched.spec_rows, {}
        if spec_rows:  # accepted drafts + one token each
            sampled.update(self.spec.accepted(out, spec_rows, sout.token_ids))
            first = {rid: len(self.seqs[rid].req.output_token_ids) for rid in spec_rows if rid in self.seqs}
        touched = self.scheduler.update(out, sampled)
        if self.beam is not None:
            self.beam.on_step(out, sout, row_of)

        if self._structured is not None:
            for req in touched:
                if self._structured.advance(req.request_id, req.output_token_ids) and not req.finished:
                    self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)  # grammar complete
            if then is not None:
                self._fill_mask(then)

        outputs: dict[str, RequestOutput] = {}
        for req in touched:
            seq = self.seqs[req.request_id]
            if req.request_id in first:
                self._on_tokens(seq, sout, spec_rows[req.request_id], first[req.request_id])
            elif seq.on_token(sout, row_of[req.request_id]) and not req.finished:  # a stop string
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.finished:
                self._drop_seq(req.request_id)
            parent = self.parents[seq.parent_id]
            if parent.record(req):
                del self.parents[parent.request_id]
            if parent.finished or parent.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs[parent.request_id] = make_output(parent, parent.finished)
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.max_model_len, self._structured or (), then)
        return list(outputs.values())

    def _on_tokens(self, seq: Sequence, sout, rows: list[int], first: int) -> None:
        """Several tokens appended in one step (accepted drafts): text, logprobs and stop
        strings token by token; tokens after a stop string are dropped, as without drafts."""
        req = seq.req
        for m, idx in enumerate(range(first, len(req.output_token_ids))):
            if seq.on_token(sout, rows[m], idx):
                del req.output_token_ids[idx + 1:]
                if req.finished:
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                return
