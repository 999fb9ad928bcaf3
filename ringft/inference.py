"""Exact long-context inference on the CP ring: sharded prefill, distributed KV cache, greedy decode.

The prompt is prefilled with zigzag ring attention (no rank ever holds the whole sequence's
activations); each rank keeps the K/V of its own prompt positions. A generated token is run on
every rank (replicated), its attention over the sharded cache is merged by log-sum-exp across
the group (``ringft.ops.decode``), and its own K/V is appended on CP rank 0. Nothing is
truncated, and results equal one-process inference up to float round-off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringft.hf import apply_ring_attention
from ringft.modeling import decoder, output_head, pretrained_model
from ringft.ops.comm import group_rank_and_size
from ringft.sharding import zigzag_position_ids, zigzag_shard


class RingInference:
    """Prefill / decode / scoring for one sequence at a time on a CP group.

    Every rank of ``cp_group`` must make the same calls with the same arguments.
    """

    def __init__(self, model: torch.nn.Module, cp_group=None, backend: str = "auto"):
        self.model = apply_ring_attention(model, cp_group, backend)
        self.model.eval()
        self.spec = pretrained_model(model)._ringft_ring
        self.group = cp_group
        self.rank, self.size = group_rank_and_size(cp_group)
        self.device = next(model.parameters()).device
        self.decoder = decoder(model)
        self.lm_head = output_head(model)
        self.length = 0

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _shard(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        total = len(ids)
        multiple = 2 * self.size
        padded = -(-total // multiple) * multiple
        full = torch.tensor(ids + [0] * (padded - total), dtype=torch.long, device=self.device)[None]
        local = zigzag_shard(full, self.rank, self.size)
        pos = zigzag_position_ids(padded, self.rank, self.size, device=self.device)[None]
        return local, pos, total

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
        """Run the prompt through the ring, fill the sharded KV cache; next-token logits ``(vocab,)``."""
        local, pos, total = self._shard(list(prompt_ids))
        self.spec.mode, self.spec.cache, self.spec.keep_local = "prefill", {}, pos[0] < total
        try:
            hidden = self.decoder(input_ids=local, position_ids=pos).last_hidden_state
        finally:
            self.spec.mode = "ring"
        self.length = total
        return self._logits_at(hidden, pos, total - 1)

    @torch.no_grad()
    def decode(self, token_id: int) -> torch.Tensor:
        """Append one token (K/V cached on CP rank 0); next-token logits ``(vocab,)``."""
        ids = torch.tensor([[token_id]], device=self.device)
        pos = torch.tensor([[self.length]], device=self.device)
        self.spec.mode = "decode"
        try:
            hidden = self.decoder(input_ids=ids, position_ids=pos).last_hidden_state
        finally:
            self.spec.mode = "ring"
        self.length += 1
        return self.lm_head(hidden[0, -1]).float()

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None
    ) -> list[int]:
        """Greedy decoding; returns the generated ids (without the prompt, without EOS)."""
        out: list[int] = []
        try:
            logits = self.prefill(prompt_ids)
            while len(out) < max_new_tokens:
                token = int(logits.argmax())
                if eos_token_id is not None and token == eos_token_id:
                    break
                out.append(token)
                if len(out) < max_new_tokens:
                    logits = self.decode(token)
        finally:
            self.spec.cache = None
        return out

    @torch.no_grad()
    def answer_logprob(self, prompt_ids: list[int], answer_ids: list[int]) -> tuple[float, bool]:
        """Teacher-forced ``log p(answer | prompt)`` (natural log) and whether every answer token is
        the argmax. One ring forward over prompt + answer; only answer positions get logits."""
        ids = list(prompt_ids) + list(answer_ids)
        local, pos, _ = self._shard(ids)
        hidden = self.decoder(input_ids=local, position_ids=pos).last_hidden_state
        start = len(prompt_ids) - 1  # position predicting the first answer token
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)  # [sum logp, wrong argmax]
        for i in range(len(answer_ids)):
            where = (pos[0] == start + i).nonzero()
            if where.numel():
                logits = self.lm_head(hidden[0, where[0, 0]]).float()
                stats[0] += torch.log_softmax(logits, -1)[answer_ids[i]].double()
                stats[1] += float(int(logits.argmax()) != answer_ids[i])
        stats = self._all_reduce(stats)
        return float(stats[0]), bool(stats[1] == 0)
