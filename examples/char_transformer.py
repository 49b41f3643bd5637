"""A character-level transformer language model on k workers: dropout, AdamW, warmup, global-norm clipping.

    phalanx run --devices cpu:2 examples/char_transformer.py --epochs 3
    torchrun --nproc-per-node 2 examples/char_transformer.py

Not a CNN and not phalanx's: a small decoder-only transformer (causal self-attention) trained to
predict the next character of a text the project ships (its README, by default; --text FILE for
another). The loss is summed over a shard's tokens and divided by the global batch's token count
(`phalanx.shard_loss`), so the gradient is the 1-device one; the learning rate warms up linearly
(torch's LambdaLR) and the summed gradient is clipped by its global norm before AdamW steps.

Dropout and k workers: each rank draws its own dropout masks (seeded by seed and rank, so ranks
do not repeat one another's masks), as any data-parallel run does; k workers then train on the
same batches with different masks than 1 device, so they agree with 1 device exactly only with
--dropout 0 (tested, 1e-9 in float64). With dropout the replicas stay identical to each other.
--exact-dropout draws the masks through `phalanx.BatchRandom` instead (the global batch's masks
on every rank, each keeping its rows): k workers then equal 1 device with dropout too (tested,
1e-9 in float64); the attention weights' own dropout, drawn inside torch's attention where no
routing reaches, is off there.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import phalanx

README = Path(__file__).resolve().parents[1] / "README.md"


class CharWindows(torch.utils.data.Dataset):
    """Windows of `block` characters and the same window shifted by one (the next-char targets)."""

    def __init__(self, ids: torch.Tensor, block: int, stride: int) -> None:
        self.ids, self.block, self.stride = ids, block, stride

    def __len__(self) -> int:
        return max(0, (len(self.ids) - self.block - 1) // self.stride + 1)

    def __getitem__(self, i: int):
        start = i * self.stride
        window = self.ids[start : start + self.block + 1]
        return window[:-1], window[1:]


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, *, block: int, d_model: int, heads: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(block, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.drop(self.tokens(ids) + self.positions(torch.arange(t, device=ids.device)))
        x = self.blocks(x, mask=self.causal[:t, :t].to(x.dtype), is_causal=True)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(README))
    p.add_argument("--max-chars", type=int, default=None, help="use only the first N characters")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="the global batch, in windows")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--exact-dropout", action="store_true",
                   help="draw dropout masks through phalanx.BatchRandom: k workers = 1 device (attention dropout off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for rank<r>.pt (this rank's parameters)")
    args = p.parse_args()

    world = phalanx.init()
    text = Path(args.text).read_text(encoding="utf-8")[: args.max_chars]
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    held_out = len(ids) // 10  # the last 10% of the text, for validation
    train = CharWindows(ids[:-held_out], args.block, stride=args.block // 2)
    valid = CharWindows(ids[-held_out:], args.block, stride=args.block)

    torch.manual_seed(args.seed)
    model = CharTransformer(len(vocab), block=args.block, d_model=args.d_model, heads=args.heads,
                            layers=args.layers, dropout=args.dropout)
    draws = phalanx.BatchRandom(world=world, seed=args.seed)
    if args.exact_dropout:
        for layer in model.blocks.layers:
            layer.self_attn.dropout = 0.0  # inside torch's attention: out of BatchRandom's reach
        draws.route_dropout(model)
    dp = phalanx.prepare(model, world=world, dtype=args.dtype)
    torch.manual_seed(args.seed * 1000 + world.rank)  # torch's dropout: each rank its own masks
    optimizer = torch.optim.AdamW(dp.module.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    loader = phalanx.ShardedLoader(train, world=world, global_batch_size=args.batch_size, seed=args.seed)

    def token_sums(model, batch):
        x, y = batch
        return {"loss": F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"), "tokens": y.numel()}

    for epoch in range(args.epochs):
        for (x, y), global_size in loader.epoch(epoch):
            x, y = x.to(world.device), y.to(world.device)
            dp.zero_grad()
            with draws.batch(global_size):  # routed dropout draws the global batch's masks, keeps this rank's
                loss_sum = F.cross_entropy(dp(x).flatten(0, 1), y.flatten(), reduction="sum")
            phalanx.shard_loss(loss_sum, global_size * args.block).backward()  # per token of the global batch
            dp.finish_gradient_sync()
            phalanx.clip_grad_norm_(dp, args.max_norm)
            optimizer.step()
            warmup.step()
        sums = phalanx.evaluate_dataset(dp.module, valid, world=world, sums=token_sums)
        if world.rank == 0:
            print(f"epoch {epoch + 1}  validation loss {sums['loss'] / sums['tokens']:.4f} nats/char  "
                  f"lr {warmup.get_last_lr()[0]:.2e}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in dp.module.state_dict().items()}, f"{args.out}/rank{world.rank}.pt")
    dp.close()


if __name__ == "__main__":
    main()
