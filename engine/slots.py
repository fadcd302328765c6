"""Which sequence holds which slot of the KV cache, and the prefixes free slots keep.

Slots are kept in three regions: decoding ``[0, D)``, prefilling ``[D, D+P)``, and
free ``[D+P, slots)``, so that a decode step reads its rows' cache through views. A
sequence enters the prefill region (``place``), moves to the end of the decode region
once its prompt is in (``promote``), and leaves (``release``), each move a swap of
slots. Free slots keep the KV of the sequence that last used them, so a later prompt
with the same prefix skips that much of its prefill (not for a model with a recurrent
state, which sums its whole sequence and cannot be cut back to a prefix).
"""

from __future__ import annotations

from .kv_cache import SlotKVCache
from .sequence import Sequence, common_prefix_len


class SlotTable:
    def __init__(self, cache: SlotKVCache) -> None:
        self.cache = cache
        self.slots: list[Sequence | None] = [None] * cache.slots
        self.decoding = 0
        self.prefilling = 0
        # Free slot → the ids whose KV it still holds, and when it was last used.
        self._free_tokens: dict[int, tuple[int, ...]] = {}
        self._free_used: dict[int, int] = {}
        self._clock = 0

    @property
    def running(self) -> int:
        return self.decoding + self.prefilling

    def in_use(self) -> list[Sequence]:
        """The running sequences: the decode region's, then the prefill region's."""
        return [seq for seq in self.slots[: self.running] if seq is not None]

    def decode_rows(self) -> list[Sequence]:
        return [seq for seq in self.slots[: self.decoding] if seq is not None]

    def prefill_rows(self) -> list[Sequence]:
        return [seq for seq in self.slots[self.decoding : self.running] if seq is not None]

    def forget_prefixes(self) -> None:
        self._free_tokens.clear()
        self._free_used.clear()

    def clear(self) -> None:
        """Every slot free, no prefix kept (after an engine error)."""
        self.slots = [None] * self.cache.slots
        self.forget_prefixes()
        self.decoding = self.prefilling = 0

    def make_room(self, longest: int, *, context_length: int, slot_limit: int, budget: int) -> bool:
        """Grow the cache so one more sequence fits and every running one can reach
        ``longest`` positions; False if that is over ``budget`` bytes."""
        need_cap = self.cache.capacity
        while need_cap < longest:
            need_cap = min(need_cap * 2, context_length)
        need_slots = self.cache.slots
        if self.running + 1 > need_slots:
            need_slots = min(max(need_slots * 2, self.running + 1), slot_limit)
        if (need_cap, need_slots) == (self.cache.capacity, self.cache.slots):
            return True
        if self.cache.bytes_for(need_slots, need_cap) > budget:
            # Fall back to only the slots in use plus this one, forgetting kept prefixes.
            need_slots = self.running + 1
            if self.cache.bytes_for(need_slots, need_cap) > budget:
                return False
            for slot in list(self._free_tokens):
                if slot >= need_slots:
                    del self._free_tokens[slot]
                    self._free_used.pop(slot, None)
        self.cache.resize(need_slots, need_cap)
        self.slots = (self.slots + [None] * need_slots)[:need_slots]
        return True

    def place(self, seq: Sequence) -> None:
        """Put ``seq`` at the end of the prefill region, reusing the best cached prefix
        of a running sequence or a free slot."""
        target = self.running
        prompt = seq.prompt
        best_len, best_slot, best_free = 0, -1, False
        # Scoring needs every prompt position; a recurrent state has no prefix to reuse.
        if seq.row.params.prompt_logprobs is None and self.cache.reuses_prefixes:
            for slot in range(self.running):
                other = self.slots[slot]
                if other is not None:
                    n = common_prefix_len(prompt, other.tokens_in_cache())
                    if n > best_len:
                        best_len, best_slot, best_free = n, slot, False
            for slot, cached in self._free_tokens.items():
                n = common_prefix_len(prompt, cached)
                if n > best_len:
                    best_len, best_slot, best_free = n, slot, True
        # At least the last prompt token is computed: its logits give the first token.
        reuse = min(best_len, len(prompt) - 1)
        if best_free and reuse > 0:
            self._swap(best_slot, target)
        else:
            victim = self._free_slot_to_use(target)
            self._swap(victim, target)
            if reuse > 0:
                self.cache.copy_prefix(best_slot, target, reuse)
        self._free_tokens.pop(target, None)
        self._free_used.pop(target, None)
        seq.slot = target
        seq.kv_len = max(reuse, 0)
        seq.cached_tokens = seq.kv_len
        self.slots[target] = seq
        self.prefilling += 1

    def promote(self, seq: Sequence) -> None:
        """``seq``'s prompt is in: move it to the end of the decode region."""
        self._swap(seq.slot, self.decoding)
        self.decoding += 1
        self.prefilling -= 1

    def release(self, seq: Sequence) -> None:
        """Take ``seq`` out of its region; its slot keeps what its KV holds."""
        slot = seq.slot
        if slot < self.decoding:
            self._swap(slot, self.decoding - 1)
            self.decoding -= 1
            slot = self.decoding
            # The prefill region starts where the decode region now ends.
            if self.prefilling:
                self._swap(slot, slot + self.prefilling)
                slot += self.prefilling
        else:
            self._swap(slot, self.running - 1)
            slot = self.running - 1
            self.prefilling -= 1
        self.slots[slot] = None
        if seq.kv_len > 0:
            self._clock += 1
            self._free_tokens[slot] = seq.tokens_in_cache()
            self._free_used[slot] = self._clock

    def _free_slot_to_use(self, first_free: int) -> int:
        """An empty slot if any, else the least recently used kept prefix."""
        for slot in range(first_free, self.cache.slots):
            if slot not in self._free_tokens:
                return slot
        return min(self._free_tokens, key=lambda s: self._free_used.get(s, 0))

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        length = max(self._slot_len(a), self._slot_len(b))
        self.cache.swap(a, b, length)
        self.slots[a], self.slots[b] = self.slots[b], self.slots[a]
        for slot in (a, b):
            seq = self.slots[slot]
            if seq is not None:
                seq.slot = slot
        fa, fb = self._free_tokens.pop(a, None), self._free_tokens.pop(b, None)
        ua, ub = self._free_used.pop(a, None), self._free_used.pop(b, None)
        if fa is not None:
            self._free_tokens[b], self._free_used[b] = fa, ua or 0
        if fb is not None:
            self._free_tokens[a], self._free_used[a] = fb, ub or 0

    def _slot_len(self, slot: int) -> int:
        seq = self.slots[slot]
        if seq is not None:
            return seq.kv_len
        return len(self._free_tokens.get(slot, ()))
