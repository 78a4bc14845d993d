"""The two recall tasks, generated from a seeded ``torch.Generator`` (nothing downloaded).

A sequence is two rows of token ids of the same length ``T``: ``tokens`` and ``tags``. The
model's input at each position is the sum of the two ids' embeddings (the model's own
embedding table; ``tags`` is ``PAD``, whose embedding is zero, where a position has no
tag). A fact is therefore ONE position that holds its key (the token) and its value (the
tag), and a question holds the key it asks about: finding the answer is a match on the
key's embedding, which a tiny model learns in a few hundred CPU steps. (Written as two
tokens ``k v``, recall needs an induction circuit: not even full attention learned it in
2000 steps at this size, nor with one token per fact, whose key the model must first
learn to read.)

Every sequence of a batch has the same length (no padding): filler tokens fill the front,
so the part that matters always ends at the last position.

**Key-value recall** (``kv``), ``n`` keys at distance ``d``::

    BOS  filler...  k1+v1  k2+v2 ... kn+vn  filler...  ki+QUERY   -> target vi

``n`` distinct keys with random values; the last position asks for key ``ki``; the target
is the value token ``vi``. The **distance** is exactly ``d = pos(question) -
pos(ki+vi)``: how far back the answer lies. It needs ``d >= n``.

**Passkey** (``passkey``), ``P`` digits at distance ``d``::

    BOS  filler...  PASS  p1+d1 ... pP+dP  filler...  p1+ASK ... pP+ASK

the passkey's ``P`` digits, each tagged on its place token ``pj``, then ``P`` questions
(place ``j`` + ``ASK``), each with the target ``dj``, exactly ``d`` positions after the
digit it asks for. Right only if all ``P`` digits are (exact match). Needs ``d >= P``.

Vocabulary (:attr:`Vocab.size` ids): ``PAD, BOS, QUERY, PASS, ASK``, then the keys, the
values, the places, the ten digits and the filler tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Vocab", "Batch", "kv_example", "passkey_example", "make_batch", "mixture_batch",
           "sequence_length", "reach", "IGNORE", "PAD"]

PAD, BOS, QUERY, PASS, ASK = 0, 1, 2, 3, 4
IGNORE = -100


@dataclass(frozen=True)
class Vocab:
    """Token ranges: ``keys`` key tokens, ``values`` value tokens, ``digits`` passkey places
    (the passkey's length ``P``), ten digits and ``fillers`` filler tokens."""

    keys: int = 16
    values: int = 16
    digits: int = 5
    fillers: int = 32

    @property
    def key0(self) -> int:
        return 5

    @property
    def value0(self) -> int:
        return self.key0 + self.keys

    @property
    def place0(self) -> int:
        return self.value0 + self.values

    @property
    def digit0(self) -> int:
        return self.place0 + self.digits

    @property
    def filler0(self) -> int:
        return self.digit0 + 10

    @property
    def size(self) -> int:
        """The number of token ids (the model's ``vocab_size``)."""
        return self.filler0 + self.fillers


@dataclass
class Batch:
    """``tokens``, ``tags`` and ``targets``, each ``(B, T)`` long (``targets``: :data:`IGNORE`
    where no answer is due); per row the task (``"kv"`` / ``"passkey"``), the number of
    keys (passkey: 0) and the distance."""

    tokens: torch.Tensor
    tags: torch.Tensor
    targets: torch.Tensor
    kinds: list[str]
    keys: list[int]
    distances: list[int]


Example = tuple[list[int], list[int], list[int]]


def _randint(high: int, g: torch.Generator, size: int = 1) -> list[int]:
    return torch.randint(high, (size,), generator=g).tolist()


def _filler(vocab: Vocab, count: int, g: torch.Generator) -> list[int]:
    return [vocab.filler0 + t for t in _randint(vocab.fillers, g, count)] if count > 0 else []


def _assemble(body: list[tuple[int, int, int]], length: int, vocab: Vocab, g: torch.Generator
              ) -> tuple[Example, int]:
    """``BOS``, filler, then ``body`` (``(token, tag, target)`` triples) ending at the last
    position; returns the example and where the body starts."""
    prefix = length - 1 - len(body)
    if prefix < 0:
        raise ValueError(f"length: {length} is too short (needs {1 + len(body)})")
    tokens = [BOS, *_filler(vocab, prefix, g), *(t for t, _, _ in body)]
    tags = [PAD] * (1 + prefix) + [tag for _, tag, _ in body]
    targets = [IGNORE] * (1 + prefix) + [y for _, _, y in body]
    return (tokens, tags, targets), 1 + prefix


def kv_example(vocab: Vocab, keys: int, distance: int, length: int, g: torch.Generator,
               extra_every: int = 0) -> Example:
    """One key-value recall sequence (module docstring), ``length`` positions.

    Parameters
    ----------
    vocab : Vocab
        The token ranges.
    keys : int
        ``n``, the facts written (``1 <= n <= vocab.keys``).
    distance : int
        ``d``, from the queried fact to the last position (``d >= n``).
    length : int
        ``T``, the sequence length (``T >= 1 + d + n``).
    g : torch.Generator
        Draws the keys, values, the queried fact and the filler.
    extra_every : int, default 0
        Training only: when positive, the filler between the facts and the last question
        also holds extra questions (a written key + ``QUERY``, its value as the target),
        each filler position one with probability ``1 / extra_every``: more answers per
        sequence, at every distance.

    Returns
    -------
    tokens, tags, targets : list of int
        ``T`` ids each; ``targets`` is :data:`IGNORE` except at the questions.
    """
    if not 1 <= keys <= vocab.keys:
        raise ValueError(f"keys: expected 1..{vocab.keys}, got {keys}")
    if distance < keys:
        raise ValueError(f"distance: expected >= keys = {keys}, got {distance}")
    ks = [vocab.key0 + k for k in torch.randperm(vocab.keys, generator=g)[:keys].tolist()]
    vs = [vocab.value0 + v for v in _randint(vocab.values, g, keys)]
    i = _randint(keys, g)[0]
    body = [(k, v, IGNORE) for k, v in zip(ks, vs, strict=True)]
    for token in _filler(vocab, distance - (keys - i), g):
        if extra_every > 0 and _randint(extra_every, g)[0] == 0:
            j = _randint(keys, g)[0]
            body.append((ks[j], QUERY, vs[j]))
        else:
            body.append((token, PAD, IGNORE))
    body.append((ks[i], QUERY, vs[i]))
    example, start = _assemble(body, length, vocab, g)
    assert (length - 1) - (start + i) == distance
    return example


def passkey_example(vocab: Vocab, distance: int, length: int, g: torch.Generator) -> Example:
    """One passkey sequence of ``P = vocab.digits`` digits (module docstring).

    Parameters
    ----------
    vocab : Vocab
        The token ranges.
    distance : int
        ``d``, from each passkey digit to the question that asks for it (``d >= P``).
    length : int
        ``T`` (``T >= 1 + d + P + 1``).
    g : torch.Generator
        Draws the digits and the filler.

    Returns
    -------
    tokens, tags, targets : list of int
        ``T`` ids each; the targets are the ``P`` digits at the ``P`` questions.
    """
    p = vocab.digits
    if distance < p:
        raise ValueError(f"distance: expected >= digits = {p}, got {distance}")
    digits = [vocab.digit0 + d for d in _randint(10, g, p)]
    places = [vocab.place0 + j for j in range(p)]
    body = [(PASS, PAD, IGNORE), *((pl, d, IGNORE) for pl, d in zip(places, digits, strict=True))]
    body += [(t, PAD, IGNORE) for t in _filler(vocab, distance - p, g)]
    body += [(pl, ASK, d) for pl, d in zip(places, digits, strict=True)]
    example, start = _assemble(body, length, vocab, g)
    assert (length - p) - (start + 1) == distance
    return example


def sequence_length(max_distance: int, max_keys: int, digits: int) -> int:
    """The shortest ``T`` that holds every setting up to these maxima (both tasks)."""
    return max(1 + max_distance + max_keys, 2 + max_distance + digits)


def make_batch(vocab: Vocab, settings: list[tuple[str, int, int]], length: int,
               g: torch.Generator, extra_every: int = 0) -> Batch:
    """A batch with one row per ``(task, keys, distance)`` of ``settings`` (``keys`` is
    ignored for ``"passkey"``; ``extra_every``: :func:`kv_example`'s)."""
    rows = []
    for kind, keys, distance in settings:
        if kind == "kv":
            rows.append(kv_example(vocab, keys, distance, length, g, extra_every))
        elif kind == "passkey":
            rows.append(passkey_example(vocab, distance, length, g))
        else:
            raise ValueError(f"task: expected 'kv' or 'passkey', got {kind!r}")
    tokens, tags, targets = (torch.tensor([r[i] for r in rows]) for i in range(3))
    return Batch(tokens, tags, targets, [s[0] for s in settings],
                 [s[1] if s[0] == "kv" else 0 for s in settings], [s[2] for s in settings])


def mixture_batch(vocab: Vocab, batch: int, max_keys: int, max_distance: int,
                  passkey_every: int, length: int, g: torch.Generator,
                  extra_every: int = 0) -> Batch:
    """A training batch from the mixture: every ``passkey_every``-th row a passkey, the
    others key-value recall with ``n`` uniform in ``1..max_keys`` (and extra questions,
    ``extra_every``); distances uniform in ``[n or P, max_distance]``."""
    settings = []
    for row in range(batch):
        passkey = passkey_every > 0 and row % passkey_every == passkey_every - 1
        keys = 0 if passkey else 1 + _randint(max_keys, g)[0]
        low = vocab.digits if passkey else keys
        settings.append(("passkey" if passkey else "kv", keys,
                         low + _randint(max_distance - low + 1, g)[0]))
    return make_batch(vocab, settings, length, g, extra_every)


def reach(window: int, layers: int) -> int:
    """The farthest back a position's output can depend on through ``layers`` sliding-window
    attention layers of ``window`` keys each (itself included): ``layers * (window - 1)``.
    Beyond it only a carried state can bring the answer."""
    return layers * (window - 1)
