"""Exact long-context inference on the CP ring: sharded prefill, distributed KV cache, greedy decode.

The prompt is prefilled with zigzag ring attention (no rank ever holds the whole sequence's
activations); each rank keeps the K/V of its own prompt positions in a
:class:`~ringft.ops.ShardedKVCache` that this object owns and hands to the attention layers as the
decoder keyword ``ring_cache``. A generated token is run on every rank (replicated), its attention
over the sharded cache is merged by log-sum-exp across the group (``ringft.ops.decode``), and its
own K/V is appended on CP rank 0. Nothing is truncated, and results equal one-process inference up
to float round-off.

2D context parallelism (``ulysses_size > 1``, or a layout from ``build_layout``) is
supported exactly: the prefill runs through Ulysses x ring; each CP rank caches the K/V of the
tokens it holds in that layout (all heads, its ``S / cp_size`` positions), so decoding is the same
merge over the CP group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringft.data.collator import pad_and_shard
from ringft.model.patch import apply_ring_attention, ring_spec
from ringft.model.unwrap import decoder, output_head
from ringft.ops import ShardedKVCache

__all__ = ["RingInference"]

EosIds = int | Sequence[int] | None  # generation stops at any of these token ids


class RingInference:
    """Prefill / decode / scoring for one sequence at a time on a CP group.

    Every rank of ``cp_group`` must make the same calls with the same arguments. Token ids are
    Python ints; logits are fp32 ``(vocab,)`` tensors, identical on every rank. ``cp_group`` and
    ``ulysses_size`` are :func:`~ringft.model.patch.apply_ring_attention`'s (a process group, or a
    Ulysses x ring layout).
    """

    def __init__(self, model: torch.nn.Module, cp_group=None, backend: str = "auto", *, ulysses_size=None):
        self.model = apply_ring_attention(model, cp_group, backend, ulysses_size=ulysses_size)
        self.model.eval()
        spec = ring_spec(model)
        self.group, self.rank, self.size = spec.group, spec.rank, spec.size
        self.ulysses_size = spec.ulysses_size
        self.device = next(model.parameters()).device
        self.decoder = decoder(model)
        self.lm_head = output_head(model)
        self.cache: ShardedKVCache | None = None

    @property
    def length(self) -> int:
        """Tokens in the cached sequence (prompt + decoded), 0 without a cache."""
        return 0 if self.cache is None else self.cache.length

    def reset(self) -> None:
        """Drop the KV cache (the next call must be :meth:`prefill`)."""
        self.cache = None

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _shard(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if not ids:
            raise ValueError("RingInference needs a non-empty prompt")
        local, pos = pad_and_shard(ids, self.rank, self.size, ulysses_size=self.ulysses_size)
        return local.to(self.device), pos.to(self.device)

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids=ids, position_ids=pos, ring_cache=self.cache).last_hidden_state

    def _logits_at(self, hidden: torch.Tensor, pos: torch.Tensor, position: int) -> torch.Tensor:
        """fp32 logits ``(vocab,)`` of global ``position``, computed by the rank holding it."""
        vocab = self.lm_head.weight.shape[0]
        logits = torch.zeros(vocab, dtype=torch.float32, device=self.device)
        where = (pos[0] == position).nonzero()
        if where.numel():
            logits += self.lm_head(hidden[0, where[0, 0]]).float()
        return self._all_reduce(logits)

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Run the prompt through the ring into a new sharded KV cache; next-token logits ``(vocab,)``."""
        local, pos = self._shard(list(prompt_ids))
        self.cache = ShardedKVCache(pos[0].tolist(), len(prompt_ids), owner=self.rank == 0)
        try:
            hidden = self._hidden(local, pos)
        except BaseException:
            self.cache = None  # half-filled
            raise
        return self._logits_at(hidden, pos, len(prompt_ids) - 1)

    @torch.no_grad()
    def decode(self, token_id: int) -> torch.Tensor:
        """Append one token (K/V cached on CP rank 0); next-token logits ``(vocab,)``."""
        if self.cache is None:
            raise RuntimeError("RingInference.decode needs a prefill first")
        ids = torch.tensor([[token_id]], device=self.device)
        pos = torch.tensor([[self.cache.length]], device=self.device)
        try:
            hidden = self._hidden(ids, pos)
        except BaseException:
            self.cache = None  # some layers appended the token, others not
            raise
        self.cache.advance()
        return self.lm_head(hidden[0, -1]).float()

    def _greedy(self, logits: torch.Tensor, max_new_tokens: int, eos_token_id: EosIds) -> list[int]:
        stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(logits.argmax())
            if token in stops:
                break
            out.append(token)
            if len(out) < max_new_tokens:
                logits = self.decode(token)
        return out

    def _teacher_forced(self, logits: torch.Tensor, answer_ids: list[int]) -> tuple[float, bool]:
        logprob, all_argmax = 0.0, True
        for i, token in enumerate(answer_ids):
            logprob += float(torch.log_softmax(logits, -1)[token])
            all_argmax &= int(logits.argmax()) == token
            if i + 1 < len(answer_ids):
                logits = self.decode(token)
        return logprob, all_argmax

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: EosIds = None) -> list[int]:
        """Greedy decoding; returns the generated ids (without the prompt, without EOS). Stops at
        ``eos_token_id`` (one id, or any of several, e.g. end-of-turn and EOS)."""
        try:
            return self._greedy(self.prefill(prompt_ids), max_new_tokens, eos_token_id)
        finally:
            self.cache = None

    @torch.no_grad()
    def generate_and_score(
        self,
        prompt_ids: list[int],
        answer_ids: list[int],
        max_new_tokens: int,
        eos_token_id: EosIds = None,
    ) -> tuple[list[int], float, bool]:
        """:meth:`generate` and :meth:`answer_logprob` of one prompt with a single prefill.

        Returns ``(generated ids without prompt/EOS, log p(answer | prompt) in nats, whether every
        answer token was the argmax)``. The answer is teacher-forced through decode steps on the
        sharded cache (exact), the cache is truncated back to the prompt, and greedy decoding starts
        from the saved prefill logits.
        """
        try:
            first = self.prefill(prompt_ids)
            logprob, all_argmax = self._teacher_forced(first, list(answer_ids))
            self.cache.truncate(len(prompt_ids))
            return self._greedy(first, max_new_tokens, eos_token_id), logprob, all_argmax
        finally:
            self.cache = None

    @torch.no_grad()
    def hidden_states(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One ring forward over ``ids`` without a KV cache (the cache, if any, is kept): this
        rank's final hidden states ``(tokens_local, hidden)`` and their global positions
        ``(tokens_local,)`` (its zigzag shard of the sequence padded to a multiple of 2 x CP; padding
        positions are ``>= len(ids)``). No logits are computed: take them in chunks
        (:mod:`ringft.loss.tokens`)."""
        local, pos = self._shard(list(ids))
        cache, self.cache = self.cache, None
        try:
            hidden = self._hidden(local, pos)
        finally:
            self.cache = cache
        return hidden[0], pos[0]

    @torch.no_grad()
    def answer_logprob(self, prompt_ids: list[int], answer_ids: list[int]) -> tuple[float, bool]:
        """Teacher-forced ``log p(answer | prompt)`` (natural log) and whether every answer token is
        the argmax. One ring forward over prompt + answer; only answer positions get logits."""
        hidden, pos = self.hidden_states(list(prompt_ids) + list(answer_ids))
        start = len(prompt_ids) - 1  # position predicting the first answer token
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)  # [sum logp, wrong argmax]
        for i in range(len(answer_ids)):
            where = (pos == start + i).nonzero()
            if where.numel():
                logits = self.lm_head(hidden[where[0, 0]]).float()
                stats[0] += torch.log_softmax(logits, -1)[answer_ids[i]].double()
                stats[1] += float(int(logits.argmax()) != answer_ids[i])
        stats = self._all_reduce(stats)
        return float(stats[0]), bool(stats[1] == 0)
