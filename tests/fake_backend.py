"""A fake of the scheduler's Backend (serving/scheduler.py): the slot programs' contract in numpy, no JAX, with a model
whose outputs a test knows in advance.

The model: a row's token i is its prompt's token i (cycled): a prompt holding the end-of-text id ends there, a
prompt of words repeats them. A token's log-probability is ``logprob(token, i)``, its top candidates the token and
the ones after it; a prompt's token is scored ``logprob(token, the token before it)``. Rows hold their state as the
device does (modelling/continuous.py's Rows): ``insert`` writes the joining rows into the slots it is given (two joiners
in one slot: an error), ``advance`` moves every row that is alive and kept, ends rows at their
end-of-text or limit and pads after, so the scheduler's bookkeeping is checked against the same rules. A row writes
its new token i at cache column ``first_token_column(p)`` + i (its prompt's length p, as a causal LM's cache;
``after_prompt=False``: 1 + i, as T5's), and ``advance(keep, n, span)`` raises ``SpanTooNarrow`` when a row still
writing would write at ``span`` or past it in these n steps, up to its last token (the span each call asked:
``spans``). A test can make a call raise (``fail``), hold the reading of calls (``gate``: a threading.Event the
scheduler's fetch waits on), and read the calls made (``calls``; ``inserts``: each insert's joiners' slots;
``scores``: each score call's prompts).

LoRA adapters (``lora_slots``: a stack of that many, ``FakeStack``): an adapter "read" from the path ``shift:K`` holds
the shift K; a row that joined with slot s's adapter writes each token t (not end-of-text or padding) as
``shifted(t, K)``, K read from the slot when each call runs, as the device reads the stack: a row still running when
its slot gets another adapter writes that one's tokens, which a test sees.
``scores``: each score call's prompts; ``controls``: each joiner's processors as the insert got them).

Processors: a row the host constrains (its key in ``masks``, decoder/grammar.py's HostMasks, asked as the device
asks it: each token's index and the token before it) writes its prompt's token where the mask allows it, else its
end-of-text token where allowed, else the lowest id allowed; a row with ``ignore_eos`` goes on past its end-of-text
token. The other processors (penalties, bias) change a model's scores, which the fake has none of: the real
programs' tests hold them (tests/modelling/test_continuous.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from decoder.grammar import HostMasks
from utils.errors import FlanT5Error


@dataclass
class Scored:
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def logprob(token, i) -> np.ndarray:
    return -((np.asarray(token) * 7 + np.asarray(i) * 3) % 11 + 1) / 8.0


@dataclass
class FakeAdapter:
    name: str
    path: str
    shift: int


def shifted(token: int, shift: int, vocab: int, eos_id: int = 1, pad_id: int = 0) -> int:
    """The token an adapter of ``shift`` writes where the base writes ``token`` (end-of-text and padding kept)."""
    if token in (eos_id, pad_id) or not shift:
        return token
    return 2 + (token - 2 + shift) % (vocab - 2)


class FakeStack:
    """A stack of ``slots`` adapters (decoder/adapters.py's AdapterStack's contract): ``read`` (a path ``shift:K``, else
    FlanT5Error), ``install`` into the first free slot (FlanT5Error when full), ``remove``; ``writes`` counts both."""

    def __init__(self, slots: int):
        self.slots, self.held, self.shift, self.writes = slots, [None] * slots, [0] * slots, 0

    def read(self, name: str, path: str) -> FakeAdapter:
        if not path.startswith("shift:"):
            raise FlanT5Error(f"adapter {name}: no checkpoint at {path}")
        return FakeAdapter(name, path, int(path[len("shift:"):]))

    def install(self, adapter: FakeAdapter) -> int:
        free = [s for s, a in enumerate(self.held) if a is None]
        if not free:
            raise FlanT5Error(f"adapter {adapter.name}: every slot holds an adapter")
        self.held[free[0]], self.shift[free[0]] = adapter, adapter.shift
        self.writes += 1
        return free[0]

    def remove(self, slot: int) -> None:
        self.held[slot], self.shift[slot] = None, 0
        self.writes += 1


class FakeBackend:
    def __init__(self, slots: int = 4, dp: int = 1, max_prompt: int = 16, steps: int = 2, eos_id: int = 1,
                 pad_id: int = 0, vocab: int = 64, top: int = 4, scores_prompts: bool = True, after_prompt: bool = True,
                 platform: str = "cpu", score_rows: int = 4, lora_slots: int = 0):
        self.slots, self.dp, self.local, self.platform, self.max_prompt = slots, dp, slots // dp, platform, max_prompt
        self.steps, self.eos_id, self.pad_id, self.vocab_size, self.top = steps, eos_id, pad_id, vocab, top
        self.scores_prompts, self.score_rows, self.after_prompt = scores_prompts, score_rows, after_prompt
        self.n_tokens = vocab
        self.masks = HostMasks(vocab, eos_id)
        self.controls: list = []  # each joiner's processors (its ``controls`` tuple, or None)
        self.spans: list = []  # the span each advance was given
        self.calls: list = []
        self.limits: list = []  # the limit each inserted row was given
        self.inserts: list = []  # each insert's joiners' slots
        self.scores: list = []  # each score call's prompts
        self.ns: list = []  # the steps of each advance
        self.fail = None  # callable(kind) -> an exception to raise, or None
        self.gate = None  # threading.Event the reading of an advance waits for
        self.resets = 0
        self.lock = threading.Lock()
        self.adapters = FakeStack(lora_slots) if lora_slots else None
        self.reset()

    def reset(self) -> None:
        self.resets += 1
        self.prompts = [[] for _ in range(self.slots)]
        self.index = np.zeros(self.slots, int)
        self.limit = np.zeros(self.slots, int)
        self.alive = np.zeros(self.slots, bool)
        self.column = np.zeros(self.slots, int)  # each row's first_token_column
        self.adapter = np.full(self.slots, -1)  # each row's adapter's slot
        self.key = np.zeros(self.slots, int)  # each row's key in ``masks`` (0: none)
        self.ignore_eos = np.zeros(self.slots, bool)
        self.last = np.zeros(self.slots, int)  # each row's last token

    def _check(self, kind: str):
        self.calls.append(kind)
        if self.fail is not None:
            e = self.fail(kind)
            if e is not None:
                raise e

    def first_token_column(self, prompt_length: int) -> int:
        return prompt_length if self.after_prompt else 1

    def token(self, slot: int, i: int, last: int = -1) -> int:
        p = self.prompts[slot]
        a = self.adapter[slot]
        natural = p[i % len(p)] if a < 0 else shifted(p[i % len(p)], self.adapters.shift[a], self.vocab_size,
                                                      self.eos_id, self.pad_id)
        if not self.key[slot]:
            return natural
        bits = self.masks(np.array([self.key[slot]]), np.array([i]), np.array([last]))[0].view(np.uint32)
        allowed = [t for t in range(self.vocab_size) if bits[t // 32] >> np.uint32(t % 32) & 1]
        return natural if natural in allowed else self.eos_id if self.eos_id in allowed else min(allowed)

    def _scored(self, tokens: np.ndarray, i: np.ndarray) -> Scored:
        """The token first among its candidates (the next ids), each 0.25 less likely than the one before."""
        lp = logprob(tokens, i)
        return Scored(lp, (tokens[..., None] + np.arange(self.top)) % self.vocab_size,
                      lp[..., None] - 0.25 * np.arange(self.top))

    def insert(self, joiners):
        self._check("insert")
        slots = [slot for slot, *_ in joiners]
        assert len(set(slots)) == len(slots) and all(0 <= s < self.slots for s in slots), slots  # one joiner a slot
        self.inserts.append(slots)
        first = np.full(len(joiners), self.pad_id)
        for k, (slot, ids, sampling, limit, *more) in enumerate(joiners):  # more: [controls[, adapter]]
            assert 0 < len(ids) <= self.max_prompt, len(ids)
            self.adapter[slot] = more[1] if len(more) > 1 else -1
            self.prompts[slot], self.index[slot], self.limit[slot] = list(ids), 0, limit
            self.column[slot] = self.first_token_column(len(ids))
            self.limits.append(int(limit))
            c = more[0] if more else None
            self.controls.append(c)
            self.key[slot], self.ignore_eos[slot] = (c[5], c[4]) if c is not None else (0, False)
            first[k] = self.last[slot] = self.token(slot, 0)
            self.alive[slot] = (first[k] != self.eos_id or self.ignore_eos[slot]) and limit > 1
        return first, self._scored(first, np.zeros(len(joiners), int))

    def advance(self, keep, n, span=None):
        self._check("advance")
        assert 1 <= n <= self.steps, n
        self.ns.append(n)
        self.spans.append(span)
        writing = self.alive & np.asarray(keep)
        # the column each row writes last in these steps: it feeds its tokens from ``index`` on, one a step, until
        # its last (``limit`` in all) is out
        last = self.column + self.index + np.minimum(n, self.limit - 1 - self.index) - 1
        if span is not None and (writing & (last >= span)).any():
            raise SpanTooNarrow(f"span {span}: rows {np.nonzero(writing & (last >= span))[0].tolist()} write up to "
                                f"column {int(last[writing].max())}")
        out = np.full((self.slots, self.steps), self.pad_id)  # the columns past n: padding
        alive = writing
        idx = np.zeros((self.slots, self.steps), int)
        for s in range(self.slots):
            for k in range(n):
                if not alive[s]:
                    break
                last = out[s, k - 1] if k else self.last[s]
                self.index[s] += 1
                out[s, k], idx[s, k] = self.token(s, self.index[s], last), self.index[s]
                self.last[s] = out[s, k]
                if (out[s, k] == self.eos_id and not self.ignore_eos[s]) or self.index[s] + 1 >= self.limit[s]:
                    alive[s] = False
        self.alive = alive
        return _Pending(out, self.gate), self._scored(out, idx)

    def score(self, prompts, adapters=None):
        self._check("score")
        assert 0 < len(prompts) <= self.score_rows, len(prompts)
        self.scores.append([list(p) for p in prompts])
        ids = np.full((self.score_rows, self.max_prompt), self.pad_id)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = p
        return self._scored(ids[:, 1:], ids[:, :-1])  # each token scored given the one before it

    def fetch(self, handle):
        if isinstance(handle, _Pending):  # an advance's tokens: read once the gate is open
            if handle.gate is not None:
                assert handle.gate.wait(60), "the test never opened the gate"
            self._check("read")  # (a device error surfaces where its tokens are read)
            return handle.out
        return handle


class SpanTooNarrow(Exception):
    pass


@dataclass
class _Pending:
    out: np.ndarray
    gate: object
