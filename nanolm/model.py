"""A small modern GPT (RoPE, RMSNorm, optional QK-norm, SwiGLU, tied embeddings) and its loss.

The layout follows Llama (and Qwen3 when ``qk_norm`` is on) closely enough that a trained
model exports to Hugging Face ``transformers`` without changing any number: pre-norm blocks,
no biases, rotary embeddings applied to the two halves of each head.

Two optional inputs make the model document-aware (``nanolm/batches.py`` makes them):

* ``doc_ids`` (B, T): which document each position belongs to. Attention is then
  block-diagonal causal: a token sees earlier tokens *of its own document* only, so the
  first word of a news story cannot read the recipe packed before it. On CUDA the mask runs
  as a FlexAttention block mask, elsewhere as SDPA with a boolean mask; both are tested
  against :func:`reference_attention`, attention written out by hand.
* ``positions`` (B, T): the rotary position of each token. Restarting them at every
  document makes a document look the same wherever it lands in a window.

The last part of this file is the loss: cross-entropy over the positions that count and only
those (:func:`masked_cross_entropy_sum`, the reference). Training computes the same sum together
with the output head, a chunk of positions at a time so that the logits are never held whole:
``nanolm/fused_loss.py``, tested against the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import NanolmError
from .fused_loss import IGNORE, head_cross_entropy_sum
from .machine import device as machine

MLP_KINDS = ("swiglu", "gelu", "relu2")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


@dataclass
class GPTConfig:
    vocab_size: int = 512
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp: str = "swiglu"
    qk_norm: bool = False
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    attention: str = "auto"
    norm_eps: float = 1e-6
    loss_chunk: int = 0  # positions per chunk of the fused head and loss; 0: loss_chunk_positions()

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise NanolmError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise NanolmError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"try n_embd={self.n_head * max(2, round(self.n_embd / self.n_head / 2) * 2)}"
            )
        if self.head_dim % 2:
            raise NanolmError(f"head size n_embd/n_head = {self.head_dim} must be even for rotary embeddings")
        if self.mlp not in MLP_KINDS:
            raise NanolmError(f"mlp must be one of {', '.join(MLP_KINDS)}, got {self.mlp!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise NanolmError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
        if self.loss_chunk < 0:
            raise NanolmError(
                f"loss_chunk must be 0 (chosen for the vocabulary and device) or positive, got {self.loss_chunk}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise NanolmError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of the MLP.

        GELU and ReLU² use the classic 4x. SwiGLU has three matrices instead of two, so its width
        is 2/3 of that (rounded up to a multiple of 32) to keep the parameter count equal.
        """
        if self.mlp in ("gelu", "relu2"):
            return 4 * self.n_embd
        return 32 * math.ceil(8 * self.n_embd / 3 / 32)


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned gain.

    Cheaper than LayerNorm (no mean, no bias) and just as stable in practice.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype != self.weight.dtype:
            # QK-norm under autocast: q and k come out of a bf16 matmul, the gain is fp32. PyTorch's
            # fused kernel wants one dtype and otherwise takes a slow composite path (a forward and
            # backward pass with --qk-norm 4-5 % slower on a CPU); normalising in fp32 and rounding back gives
            # the same numbers, at the fused kernel's speed
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float):
    """cos and sin of every (position, frequency) pair, in fp32, shape (seq_len, head_dim).

    Frequencies are duplicated across the two halves of a head, the layout that Llama
    expects. The first half of ``sin`` is negated: rotating a pair (x_i, x_{i+d/2}) gives
    (x_i cos - x_{i+d/2} sin, x_{i+d/2} cos + x_i sin), and with the sign stored in the table
    :func:`apply_rope` needs no negation of x at every call.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    sin = angles.sin()
    return torch.cat([angles, angles], dim=-1).cos().float(), torch.cat([-sin, sin], dim=-1).float()


def apply_rope(x, cos, sin):
    """Rotate each pair (x_i, x_{i+d/2}) by its position's angle (``sin`` from :func:`rope_tables`).

    After rotation the dot product of a query and a key depends only on how far apart
    they are, which is what makes the model's sense of order relative. Swapping the two
    halves is one ``roll``; the sign is in the table. The numbers are bit for bit those of
    the textbook ``x * cos + rotate_half(x) * sin`` (negating a factor is exact) with ~40 %
    less time in RoPE's forward and backward on CPU (benchmarks/throughput.py --ablations).

    The tables are fp32 and autocast leaves elementwise products alone, so under autocast a
    16-bit q or k would come out of the rotation promoted to fp32 while v stays 16-bit:
    attention kernels that want one dtype (FlexAttention checks) refuse that, others run
    their slow fp32 path. The rotation is computed in fp32 and rounded once, to x's dtype.
    """
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask: True where query t may attend to key s.

    Allowed means s <= t *and* both positions belong to the same document.
    """
    T = doc_ids.shape[1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def fused_on(t: torch.Tensor) -> bool:
    """FlexAttention and its block mask are compiled into fused Triton kernels on CUDA; elsewhere
    they run eagerly (forward only on a CPU), which is fine at CPU sizes."""
    return t.is_cuda


_compiled: dict[str, object] = {}


def compiled_once(fn):
    """``torch.compile(fn)``, made once per process, and never while ``torch.compile`` traces.

    Why the second half matters: with ``--compile`` the first call usually comes from inside
    the traced model, where the enclosing compilation fuses FlexAttention itself and a wrapper
    made there would be the raw function (compilations do not nest). Kept for later, it would
    leave every eager call unfused: the whole B x H x T x T score matrix and a dense block mask,
    the same numbers, silently slower and larger."""
    if torch.compiler.is_compiling():
        return fn
    if fn.__name__ not in _compiled:
        _compiled[fn.__name__] = torch.compile(fn, dynamic=False)
    return _compiled[fn.__name__]


def flex_document_mask(doc_ids: torch.Tensor):
    """The document mask as a FlexAttention ``BlockMask``, built once per batch.

    FlexAttention skips every (query block, key block) tile that the mask empties, so a
    window packed with many short documents costs less than full causal attention, where
    a dense boolean mask would cost more. The block mask is computed once per forward and
    shared by all layers. Compiled, it never materialises the (B, T, T) mask; eager (off
    CUDA) builds it densely once.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def same_document_and_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    build = compiled_once(create_block_mask) if fused_on(doc_ids) else create_block_mask
    return build(same_document_and_causal, B, None, T, T, device=doc_ids.device)


def flex_attention(q, k, v, block_mask):
    """FlexAttention, compiled into a fused kernel on GPU (eager elsewhere: forward only)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return (compiled_once(flex) if fused_on(q) else flex)(q, k, v, block_mask=block_mask)


def attention(q, k, v, **kwargs):
    """``F.scaled_dot_product_attention``, in fp32 when a CPU runs under autocast.

    On CPU, PyTorch's flash-attention kernel is several times slower in bf16 than in fp32
    for the backward pass, while the Linear layers' matrix multiplies are faster in bf16 on a
    CPU with native bf16 dot products (``benchmarks/throughput.py --ablations``; the figures are
    in docs/benchmarks.md). So under CPU
    autocast only the Linear layers use bf16 and attention keeps fp32 inputs. Elsewhere
    (CUDA, plain fp32) this is SDPA itself.
    """
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def reference_attention(q, k, v, mask=None):
    """Attention written out by hand: softmax(q k^T / sqrt(d) + mask) v.

    Slow and obviously right; tests compare the fast path against it. ``mask`` is a
    boolean tensor broadcastable to (B, H, Tq, Tk); without one, attention is causal.
    """
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is None:
        Tq, Tk = q.shape[-2], k.shape[-2]
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


class KVCache:
    """Keys and values of every layer for positions already processed during generation.

    Without it, producing token n re-runs attention for all n previous tokens; with it,
    each new token costs one row of attention.
    """

    def __init__(self, config: GPTConfig, batch_size: int, device, dtype):
        shape = (config.n_layer, batch_size, config.n_head, config.seq_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, layer: int, k, v):
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None

    def queries_keys_values(self, x, cos, sin):
        """q, k, v of shape (B, n_head, T, head_dim), with QK-norm and RoPE applied.

        Exactly what attention compares: ``q @ k^T / sqrt(head_dim)`` are the logits the
        softmax sees (``nanolm.watch.stats`` recomputes them to watch their maximum).

        The one ``qkv`` matrix multiply is split along its features into three views. (Viewing
        it as (3, B, H, T, D) and indexing ``[0]``, ``[1]``, ``[2]`` gives the same numbers, but
        autograd then backpropagates each index through a zero-filled gradient of the whole
        (3, B, H, T, D) tensor and a strided copy; a split's backward is one concatenation.)
        """
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None):
        B, T, C = x.shape
        q, k, v = self.queries_keys_values(x, cos, sin)
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
        dropout = self.dropout if self.training else 0.0
        if mask is not None and not isinstance(mask, torch.Tensor):
            y = flex_attention(q, k, v, mask)
        elif mask is not None:
            y = attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        elif T == k.shape[2]:
            y = attention(q, k, v, is_causal=True, dropout_p=dropout)
        elif T == 1:  # one new token during generation: it may see every cached key
            y = attention(q, k, v)
        else:
            allowed = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - T)
            y = attention(q, k, v, attn_mask=allowed)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        hidden = config.mlp_hidden
        if self.kind == "swiglu":
            self.gate = nn.Linear(config.n_embd, hidden, bias=False)
        self.up = nn.Linear(config.n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.kind == "relu2":  # ReLU squared (Primer, So et al. 2021; modded-nanogpt's MLP): two matrices, no gate
            return self.down(F.relu(self.up(x)).square())
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, mask=None, cache=None):
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin, mask, cache))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def _run_block(block, x, cos, sin, mask):
    return block(x, cos, sin, mask)


def compile_blocks(model: "GPT", backend: str = "inductor") -> None:
    """``--compile``: the training passes run every block through one function, compiled once.

    Why the blocks and not the whole model (torchtitan compiles the same way): every block is
    the same code on other weights, so the compiler traces and generates code for one block
    and all of them reuse it, where compiling the whole model traces every block again, and the
    head's loss, a chunk at a time, unrolled. Most of what compiling wins is inside the blocks:
    RoPE, the norms, the activation and autocast's casts fused into a few kernels instead of a
    pass over memory each (docs/benchmarks.md has the compile time and the step time of both).
    Only passes that compute gradients take it: an evaluation or a sample runs under
    ``no_grad``, at other batch sizes and lengths, and would each be compiled again for a few
    forward passes."""
    model.compiled_block = torch.compile(_run_block, dynamic=False, backend=backend)


def flex_attention_chosen(attention: str, device) -> bool:
    """The one rule for the document mask's kernel: FlexAttention when ``--attention flex`` asks
    for it, or under ``auto`` on CUDA with Triton (there it is a compiled kernel, far cheaper than a
    boolean mask); SDPA with a boolean mask everywhere else."""
    return attention == "flex" or (attention == "auto" and torch.device(device).type == "cuda" and machine.has_triton())


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(config.seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.compiled_block = None  # set by compile_blocks: the training passes' compiled block
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Initialise so that a fresh model predicts (almost) uniformly: loss ≈ ln V.

        Every matrix gets N(0, 0.02). The two projections that write into the residual
        stream (attention output, MLP down) get 0.02 / sqrt(2 · n_layer): each block adds
        two such contributions, and this keeps the residual stream's variance from growing
        with depth.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of trainable parameters (a tied matrix counts once).

        ``non_embedding=True`` leaves out the input embedding table, the convention of
        scaling-law papers; an untied output matrix is still counted.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: forward + backward = 3 × forward, 2 FLOPs per MAC.

        6 per weight in a matrix multiply (every Linear, including the output head, but not
        the embedding lookup) plus attention's own two matmuls, QK^T and AV: 12 · T · d per
        layer. Causal attention could skip half of the latter; like PaLM, nanoGPT and
        torchtitan we count it whole, so MFU figures compare across projects.
        """
        c = self.config
        T = seq_len or c.seq_len
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention = 12 * c.n_layer * T * c.n_embd
        return 6 * matmul_params + attention

    def rope(self, T: int, positions: torch.Tensor | None, offset: int = 0):
        if positions is None:
            return self.rope_cos[offset : offset + T], self.rope_sin[offset : offset + T]
        return self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)

    def uses_flex_attention(self, device) -> bool:
        """FlexAttention for the document mask on CUDA (auto; it is a Triton kernel there), SDPA
        with a boolean mask elsewhere. Dropout needs SDPA: FlexAttention has none."""
        if self.config.attention == "sdpa" or (self.training and self.config.dropout > 0):
            return False
        return flex_attention_chosen(self.config.attention, device)

    def attention_mask(self, doc_ids):
        """Which positions may attend to which: None is plain causal attention (the kernels'
        own causal path); with ``doc_ids``, causal and within one document."""
        if doc_ids is None:
            return None
        if self.uses_flex_attention(doc_ids.device):
            return flex_document_mask(doc_ids)
        return document_causal_mask(doc_ids)

    def forward(self, idx, targets=None, doc_ids=None, positions=None, loss_mask=None, reduction="mean"):
        """``(logits, None)``: the logits of every position; or, given ``targets``, ``(None, loss)``.

        ``targets`` are the next tokens; positions where ``loss_mask`` is False (or the target
        is negative) are not counted. The loss is their mean (0 when none counts), or with
        ``reduction="sum"`` their sum, which the training step divides by the count of its
        whole step. With targets the logits are never held whole: the head and the loss run
        a chunk of positions at a time (``config.loss_chunk``; :func:`head_cross_entropy_sum`
        says why), so none are returned.
        """
        B, T = idx.shape
        if T > self.config.seq_len:
            raise NanolmError(f"sequence of {T} tokens is longer than seq_len={self.config.seq_len}")
        cos, sin = self.rope(T, positions)
        mask = self.attention_mask(doc_ids)
        x = self.embed(idx)
        compiled = self.compiled_block if torch.is_grad_enabled() else None  # evaluation and sampling stay eager
        for block in self.blocks:
            x = block(x, cos, sin, mask) if compiled is None else compiled(block, x, cos, sin, mask)
        x = self.norm(x)
        if targets is None:
            return self.lm_head(x), None
        if reduction not in ("mean", "sum"):
            raise NanolmError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        total, count = head_cross_entropy_sum(x, self.lm_head.weight, targets, loss_mask, self.config.loss_chunk)
        return None, total if reduction == "sum" else total / count.clamp(min=1)

    def forward_cached(self, idx, cache: KVCache):
        """Logits of the new tokens ``idx``, reading and extending ``cache``."""
        T = idx.shape[1]
        cos, sin = self.rope(T, None, offset=cache.length)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin, None, cache)
        cache.length += T
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue each row of ``idx`` (B, T) by up to ``max_new_tokens`` tokens.

        ``temperature`` 0 means greedy. ``top_k`` keeps the k most likely tokens,
        ``top_p`` the smallest set whose probability reaches p (nucleus sampling).
        Generation stops once every row has produced ``eos_id``; rows that finished
        early are padded with ``eos_id``. Pass a seeded ``generator`` for repeatable text.
        When the context fills up, the cache is rebuilt from the last half window.
        """
        was_training = self.training
        self.eval()
        B = idx.shape[0]
        dtype = self.embed.weight.dtype
        cache = KVCache(self.config, B, idx.device, dtype)
        logits = self.forward_cached(idx[:, -self.config.seq_len :], cache)[:, -1]
        finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
        out = [idx]
        for _ in range(max_new_tokens):
            next_token = sample_next_token(logits, temperature, top_k, top_p, generator)
            if eos_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_id), next_token)
                finished |= next_token == eos_id
            out.append(next_token[:, None])
            if eos_id is not None and bool(finished.all()):
                break
            if cache.length >= self.config.seq_len:
                context = torch.cat(out, dim=1)[:, -(self.config.seq_len // 2) :]
                cache = KVCache(self.config, B, idx.device, dtype)
                logits = self.forward_cached(context, cache)[:, -1]
            else:
                logits = self.forward_cached(next_token[:, None], cache)[:, -1]
        self.train(was_training)
        return torch.cat(out, dim=1)


# --------------------------------------------------------------------------- the loss
# Not every position of a batch should count: padding, a prompt we condition on, the token
# after a document boundary when that option is on. The loss is
#
#     sum over counted positions of -log p(target)   /   number of counted positions
#
# and masked positions contribute nothing at all, whatever their logits hold. The division is
# kept apart (masked_cross_entropy_sum returns both): which count divides is the step's to
# decide (``nanolm.step.accumulate_gradients`` says why it is the whole step's).


def masked_cross_entropy_sum(logits, targets, mask=None):
    """(sum of per-token cross-entropy over counted positions, number of counted positions).

    Computed in fp32 whatever the logits' dtype. Both results are tensors on the logits'
    device, so no host synchronisation happens here.
    """
    if mask is None:
        mask = targets >= 0
    mask = mask.bool()
    counted_targets = torch.where(mask, targets, torch.full_like(targets, IGNORE))
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        counted_targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return total, mask.sum()


def masked_cross_entropy(logits, targets, mask=None):
    """Mean cross-entropy over counted positions; 0 (not NaN) when none is counted."""
    total, count = masked_cross_entropy_sum(logits, targets, mask)
    return total / count.clamp(min=1)


# --------------------------------------------------------------------------- sampling
def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Draw one token id per row from ``logits`` (B, V)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keeps the token crossing p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
