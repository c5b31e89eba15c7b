"""A trained draft head (EAGLE, Li et al. 2024): one decoder layer that reads the target's own
features, so drafting costs a small fraction of a target step.

Feature f_i = the input of the target's LM head at position i (what turns into its logits for
token i+1). The head reads the pair (f_i, embedding of token i+1) at position i and predicts
f_{i+1}; the target's LM head rows for a frequent-token sub-vocabulary turn that into draft logits.
The pair also carries the embeddings of what prompt lookup would copy next (the token that last
followed the same bigram and unigram earlier in the text): the target often copies a schema's
descriptions, which one layer cannot find on its own. A gate then mixes the proposals into
the draft distribution itself (pointer-generator style): q = π₀ softmax(W_sub h) + Σ πₙ one-hot(copy
n), with π = softmax(0, gate(h)). Copying becomes one learned weight instead of a route for an
embedding through the layer; q stays a distribution the draft is drawn from, so the rule is exact.
q = 0 outside the sub-vocabulary is still exact: those tokens are only ever reached through the
target's residual. Committed positions use the target's true features (from its verify passes);
positions drafted this round use the head's own prediction, and are dropped at the next round.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import DraftHeadError, VocabularyMismatch
from ..model import kv

HEADS = Path(__file__).parent / "heads"  # shipped weights: <name>.safetensors + <name>.json card
COPY_NGRAMS = (2, 1)  # the head's copy proposals: after the last bigram, after the last token
# The target's config fields the head's decoder layer copies (width, attention shape, RoPE).
_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "hidden_act",
)


class DraftHead(nn.Module):
    def __init__(self, layer_config: dict, draft_ids: torch.Tensor):
        from transformers import LlamaConfig, LlamaModel  # here: ≈ 0.5 s to import

        super().__init__()
        config = LlamaConfig(
            **layer_config,
            num_hidden_layers=1,
            vocab_size=1,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        )
        width = config.hidden_size
        self.layer_config = dict(layer_config)
        # (feature, token embedding, copy proposals' embeddings) → layer input
        self.fuse = nn.Linear((2 + len(COPY_NGRAMS)) * width, width)
        self.decoder = LlamaModel(config)  # one layer's weights, RoPE, final norm
        # output → log weight of each copy proposal against the head's softmax (0). Closed
        # (-inf) until trained: a head trained without it drafts exactly as it did.
        self.copy_gate = nn.Linear(width, len(COPY_NGRAMS))
        nn.init.zeros_(self.copy_gate.weight)
        nn.init.constant_(self.copy_gate.bias, float("-inf"))
        self.register_buffer("draft_ids", draft_ids.long().clone())  # the sub-vocabulary

    @classmethod
    def for_target(cls, target, draft_ids: torch.Tensor) -> DraftHead:
        fields = {
            k: getattr(target.config, k)
            for k in _LAYER_FIELDS
            if getattr(target.config, k, None) is not None
        }
        return cls(fields, draft_ids)

    def forward(
        self, features: torch.Tensor, embeddings: torch.Tensor, cache: HeadCache | None = None
    ) -> torch.Tensor:
        """(B, n, d) features and ``pair_embeddings`` (B, n, (1 + len(COPY_NGRAMS)) d) → (B, n, d)
        predicted next features,
        causal over the n pairs and after what ``cache`` holds (which it extends).

        The decoder layer's modules are called directly (``project``, ``attend``): LlamaModel's
        own forward spends milliseconds per call on bookkeeping, many times this layer's
        arithmetic, and drafting calls it once per token."""
        x = self.fuse(torch.cat([features, embeddings], dim=-1))
        start, n = (len(cache) if cache is not None else 0), x.shape[1]
        pos = torch.arange(start, start + n, device=x.device)
        q, k, v = self.project(x, pos)
        if cache is not None:
            k, v = cache.extend(k, v)
        causal = (
            None if n == 1 else torch.arange(start + n, device=x.device)[None, :] <= pos[:, None]
        )  # (n, start + n)
        return self.attend(x, q, k, v, causal)

    def log_probs(
        self, out: torch.Tensor, rows: torch.Tensor, copies: torch.Tensor
    ) -> torch.Tensor:
        """log q over the draft vocabulary (N ids; ``rows``: their LM-head rows, (N, d)) for
        outputs ``out`` (n, d) and their copy proposals ``copies`` (n, len(COPY_NGRAMS)) as
        indices into that vocabulary (-1: none, or outside it) → (n, N)."""
        gate = self.copy_gate(out).masked_fill(copies < 0, float("-inf"))
        weights = torch.log_softmax(torch.cat([gate.new_zeros(len(out), 1), gate], 1), 1)
        logq = torch.log_softmax(out @ rows.T, -1) + weights[:, :1]
        for n in range(copies.shape[1]):  # add each proposal's mass to its token's
            at = copies[:, n : n + 1].clamp(min=0)
            logq = logq.scatter(
                1, at, torch.logaddexp(logq.gather(1, at), weights[:, n + 1 : n + 2])
            )
        return logq

    def project(self, x: torch.Tensor, pos: torch.Tensor):
        """Queries, keys and values (B, heads, n, head dim) of layer inputs x (B, n, d) at
        positions ``pos``, RoPE applied."""
        (layer,), attn = self.decoder.layers, self.decoder.layers[0].self_attn
        cos, sin = self.decoder.rotary_emb(x, pos[None])
        h = layer.input_layernorm(x)
        q, k, v = (
            proj(h).view(*x.shape[:2], -1, attn.head_dim).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        return (*apply_rotary_pos_emb(q, k, cos, sin), v)

    def attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The rest of the layer after ``project``: attention of q over keys/values (mask: True
        where a query may look), the MLP, the final norm → (B, n, d)."""
        (layer,), attn = self.decoder.layers, self.decoder.layers[0].self_attn
        a = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True
        )
        x = x + attn.o_proj(a.transpose(1, 2).reshape(*x.shape[:2], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.decoder.norm(x)

    def save(self, path: str | Path, card: dict) -> None:
        """fp16 safetensors (the embedding stub of the 1-layer LlamaModel left out) + a JSON card
        with the layer config, the weights' sha256 and whatever the trainer reports."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {
            k: (v.half() if v.is_floating_point() else v).contiguous()
            for k, v in self.state_dict().items()
            if "embed_tokens" not in k
        }
        save_file(tensors, path)
        card = {
            **card,
            "layer_config": self.layer_config,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        path.with_suffix(".json").write_text(json.dumps(card, indent=1) + "\n")


def unrolled(head, f: torch.Tensor, e: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs at draft steps 1..``steps`` for every position of one sequence, each
    step reading the previous step's outputs as it does when drafting (EAGLE-3's training-time
    test). Step s at position j reads (step s-1's output at j-1, e_j) and, as in the drafting
    head's KV cache, attends to the true pairs up to j-s and to its own chain's pairs
    j-s+1..j. One pass per step; the keys of earlier steps are kept. Step 1 = ``head(f, e)``."""
    m = f.shape[0]
    pos = torch.arange(m)
    keys, values, outs, inputs = [], [], [], f
    for s in range(steps):
        x = head.fuse(torch.cat([inputs, e], dim=-1))[None]
        q, k, v = head.project(x, pos)
        keys.append(k)
        values.append(v)
        # block 0 (true pairs): keys j' <= j - s; block t >= 1: the chain's key j' = j - (s - t)
        allowed = [pos[None, :] <= pos[:, None] - s] + [
            pos[None, :] == pos[:, None] - (s - t) for t in range(1, s + 1)
        ]
        outs.append(
            head.attend(x, q, torch.cat(keys, 2), torch.cat(values, 2), torch.cat(allowed, 1))[0]
        )
        inputs = torch.cat([torch.zeros_like(f[:1]), outs[-1][:-1]])  # position 0: no chain
    return outs


class CopyIndex:
    """Prompt lookup for the head's input: the token that last followed each n-gram of a token
    list. Append-only; ``proposal`` also searches the unindexed tail of a longer context."""

    def __init__(self, n: int):
        self.n, self.ids, self.next = n, [], {}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            if len(self.ids) >= self.n:
                self.next[tuple(self.ids[-self.n :])] = token
            self.ids.append(token)

    def proposal(self, context: list[int]) -> int:
        """The token after the latest earlier occurrence of ``context``'s last n tokens, or -1.
        ``context`` starts with the indexed ids."""
        n, key = self.n, tuple(context[-self.n :])
        if len(context) <= n:
            return -1
        for m in range(len(context) - 2, max(len(self.ids) - 2, n - 2), -1):  # the tail first
            if tuple(context[m - n + 1 : m + 1]) == key:
                return context[m + 1]
        return self.next.get(key, -1)


class CopyProposals:
    """Row j: each COPY_NGRAMS proposal for the token after ``context[:j + 1]`` (-1: none). Rows of
    committed positions are computed once, in order (the index then holds exactly the text
    before them, as in training); drafted positions search the index plus the draft's tail."""

    def __init__(self):
        self.indexes, self.rows, self.text = [CopyIndex(n) for n in COPY_NGRAMS], [], []

    def between(
        self, context: list[int], start: int, stop: int, committed: bool = False
    ) -> list[list[int]]:
        """Rows start..stop-1."""
        if context[: len(self.text)] != self.text:  # another text: start afresh
            self.__init__()
        if not committed:
            return [
                [index.proposal(context[: j + 1]) for index in self.indexes]
                for j in range(start, stop)
            ]
        for j in range(len(self.rows), stop):
            for index in self.indexes:
                index.extend(context[len(index.ids) : j])
            self.rows.append([index.proposal(context[: j + 1]) for index in self.indexes])
        self.text = context[: len(self.rows)]
        return self.rows[start:stop]


def copy_proposals(ids: list[int]) -> list[list[int]]:
    """Every row of CopyProposals for ``ids`` (training reads them all at once)."""
    return CopyProposals().between(ids, 0, len(ids), committed=True)


def vocabulary_positions(vocab: torch.Tensor, proposals: list[list[int]]) -> torch.Tensor:
    """Copy proposals (token ids, -1: none) as indices into the sorted draft vocabulary ``vocab``
    (-1: none, or not in it) → (n, len(COPY_NGRAMS)) long."""
    tokens = torch.tensor(proposals, dtype=torch.long, device=vocab.device).reshape(
        len(proposals), -1
    )
    at = torch.searchsorted(vocab, tokens.clamp(min=0)).clamp(max=len(vocab) - 1)
    return at.masked_fill((tokens < 0) | (vocab[at] != tokens), -1)


def pair_embeddings(embed, tokens: list[int], proposals: list[list[int]]) -> torch.Tensor:
    """(n, (1 + len(COPY_NGRAMS)) d): each token's embedding and its copy proposals' (0: none)."""
    device = next(itertools.chain(embed.parameters(), embed.buffers())).device  # or BlockRows' q
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    copies = torch.tensor(proposals, dtype=torch.long, device=device).reshape(len(tokens), -1)
    found = (copies >= 0).unsqueeze(-1)
    copied = (embed(copies.clamp(min=0)) * found).flatten(1)  # (n, len(COPY_NGRAMS) d)
    return torch.cat([embed(ids), copied], dim=-1).float()


class HeadCache:
    """The head's keys and values, (B, kv heads, positions, head dim): cropping is slicing."""

    def __init__(self):
        self.keys = self.values = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor):
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], 2), torch.cat([self.values, values], 2)
        self.keys, self.values = keys, values
        return keys, values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def draft_vocabulary(sub_vocab: torch.Tensor, prompt: list[int]) -> torch.Tensor:
    """The ids a head drafts from for one request: its frequent-token sub-vocabulary plus the
    prompt's own tokens (answers reuse the rare words of a schema's descriptions), sorted."""
    prompt_ids = torch.tensor(prompt, dtype=torch.long, device=sub_vocab.device)
    return torch.unique(torch.cat([sub_vocab, prompt_ids]))


def has_shipped_head(model_name) -> bool:
    """Whether weights trained here ship for this built-in model name (not a path or hub id)."""
    return (
        isinstance(model_name, str)
        and "/" not in model_name
        and _shipped_path(model_name).is_file()
    )


def _shipped_path(model_name: str) -> Path:
    return HEADS / f"{model_name}.safetensors"


def shipped_head(model_name: str) -> Path:
    """The weights trained here for a built-in model, or a clear error (before any model work)."""
    path = _shipped_path(model_name)
    if not path.is_file():
        have = sorted(p.stem for p in HEADS.glob("*.safetensors")) or ["none"]
        raise DraftHeadError(
            f"no trained draft head ships for {model_name!r} (heads: "
            f"{', '.join(have)}): pass a head file path as draft=, train one with "
            "`python tools/train_head.py --model ... --out ...`, or use "
            "draft='lookup'."
        )
    return path


def load_head(target, vocab, path: str | Path) -> DraftHead:
    """A trained head for ``target``, checked: file present and intact, same tokenizer, same width."""
    path = Path(path)
    card_path = path.with_suffix(".json")
    if not path.is_file() or not card_path.is_file():
        raise DraftHeadError(
            f"draft head weights not found: {path} and {card_path.name} are both "
            "needed. Reinstall constrained_spec, or retrain with "
            "`python tools/train_head.py`."
        )
    card = json.loads(card_path.read_text())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != card.get("sha256"):
        raise DraftHeadError(
            f"draft head weights {path} are corrupt (sha256 {digest[:12]}… ≠ "
            f"{str(card.get('sha256'))[:12]}… in {card_path.name}): reinstall or "
            "retrain them."
        )
    if card.get("vocab_fingerprint") not in (None, vocab.fingerprint):
        raise VocabularyMismatch(
            f"the draft head {path.name} was trained for another tokenizer: "
            "use it with the model it was trained on, or retrain it."
        )
    width = target.config.hidden_size  # the features' width (DraftHead.for_target's)
    if card["layer_config"].get("hidden_size") != width:
        raise VocabularyMismatch(
            f"the draft head {path.name} reads {card['layer_config']['hidden_size']}"
            f"-wide features but the target's are {width}-wide: it belongs "
            "to another model."
        )
    from safetensors.torch import load_file

    tensors = load_file(path)
    head = DraftHead(card["layer_config"], tensors["draft_ids"])
    fuse = tensors.get("fuse.weight")
    if fuse is not None and fuse.shape[1] == 2 * width:  # trained before the copy proposals:
        tensors["fuse.weight"] = torch.cat(  # zero weights on them reproduce it
            [fuse, fuse.new_zeros(width, head.fuse.in_features - 2 * width)], 1
        )
    try:
        missing, unexpected = head.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        missing, unexpected = [str(e).splitlines()[-1].strip()], []
    # no copy_gate weights: a head from before the gate, which stays closed (drafts as it did)
    if unexpected or [k for k in missing if "embed_tokens" not in k and "copy_gate" not in k]:
        raise DraftHeadError(
            f"draft head weights {path} do not fit the head's layout "
            f"(missing {missing}, unexpected {unexpected}): retrain them."
        )
    return head.float().eval()


class HeadDraft:
    """The head as a drafter's model: ``scores`` like DraftModel, fed the target's features
    through ``begin`` (after prefill) and ``observe`` (after each round) by the decode loop.

    Invariant: ``features`` holds the target's features for every committed token but the last
    (as the target's KV cache holds them); the head cache holds pairs 0..n-1 for tokens ``ids``."""

    uses_features = True

    def __init__(self, head: DraftHead, target):
        self.head = head
        self.device = next(target.parameters()).device
        self.head.to(self.device)
        self.embed = target.get_input_embeddings()
        self.target = target  # its LM head's rows of the sub-vocabulary: kv.head_rows
        self._use_vocabulary(head.draft_ids.to(self.device))
        self.cache = HeadCache()
        self.features = torch.empty(0, self.rows.shape[1], device=self.device)
        self.ids: list[int] = []  # pair i in the cache = (feature i, embedding of ids[i + 1])
        self.true_pairs = 0  # cached pairs built from the target's features, not the head's
        self.last: torch.Tensor | None = None  # head output at the last cached pair
        self.last_copies: list[int] = []  # and the copy proposals for the token it predicts
        self.copies = CopyProposals()

    def begin(self, prompt: list[int], features: torch.Tensor) -> None:
        """A new request: the target's features over ``prompt[:-1]`` (its prefill)."""
        self._use_vocabulary(draft_vocabulary(self.head.draft_ids.to(self.device), prompt))
        self.features = features.float().reshape(-1, self.rows.shape[1])
        self.copies = CopyProposals()
        self._drop_to(0)

    def observe(self, committed: list[int], features: torch.Tensor) -> None:
        """The round committed ``committed``; ``features``: the target's features over the
        positions fed this round that are now committed (the previous last token + accepted)."""
        self._drop_to(self.true_pairs)  # pairs built from predicted features are stale now
        self.features = torch.cat([self.features, features.float()])

    @torch.inference_mode()
    def scores(self, context: list[int], state: int, constraint):
        """(logits, legal mask, token ids) over the sub-vocabulary for the token after
        ``context``; None when the head has nothing to read (a one-token prompt)."""
        self._sync(context)
        if self.last is None:
            return None
        copies = vocabulary_positions(self.draft_ids, [self.last_copies])
        return (
            self.head.log_probs(self.last[None], self.rows, copies)[0],
            constraint.mask(state, self.device)[self.draft_ids],
            self.draft_ids,
        )

    def _sync(self, context: list[int]) -> None:
        """Feed the head every pair of ``context`` it has not seen: true features in one pass,
        then one step per drafted position (its feature is the head's previous output)."""
        pairs = len(self.cache)
        same = next(
            (i for i, (a, b) in enumerate(zip(self.ids, context)) if a != b),
            min(len(self.ids), len(context)),
        )
        if same - 1 < pairs:  # the context left the cached path: back to the last true pair
            pairs = self._drop_to(max(min(same - 1, self.true_pairs), 0))
        end, known = len(context) - 1, len(self.features)
        if self.last is None and pairs >= min(end, known) and pairs > 0:
            pairs = self._drop_to(pairs - 1)  # refeed one pair to get the head's output back
        self.ids = list(context)
        if pairs < min(end, known):
            b = min(end, known)
            out = self._step(self.features[pairs:b], context, pairs, b, committed=True)
            self.last, self.true_pairs, pairs = out[-1], b, b
        for i in range(pairs, end):
            if self.last is None:  # no feature at all (a one-token prompt): nothing to read
                return
            self.last = self._step(self.last[None], context, i, i + 1)[-1]

    def _use_vocabulary(self, ids: torch.Tensor) -> None:
        self.draft_ids = ids
        self.rows = kv.head_rows(self.target, ids).to(self.device)  # (N, d)

    def _step(
        self,
        features: torch.Tensor,
        context: list[int],
        start: int,
        stop: int,
        committed: bool = False,
    ) -> torch.Tensor:
        """The head over pairs start..stop-1 of ``context``; ``committed``: their tokens are the
        target's, so the copy index may grow over them."""
        proposals = self.copies.between(context, start + 1, stop + 1, committed)  # after token j
        self.last_copies = proposals[-1]
        embeddings = pair_embeddings(self.embed, context[start + 1 : stop + 1], proposals)
        return self.head(features[None], embeddings[None], self.cache)[0]

    def _drop_to(self, pairs: int) -> int:
        pairs = min(pairs, len(self.cache))
        self.cache.crop(pairs)
        self.true_pairs = min(self.true_pairs, pairs)
        self.ids = self.ids[: pairs + 1] if pairs else []
        self.last = None
        return pairs
